"""Tiny image models of real architectures for the tests: random weights from a transformers config, saved with
`save_pretrained`, with the locally trained tokenizer (plus the model's image token) and the family's real
processor (the PIL image processors: torchvision does not load beside the CPU torch). Nothing is downloaded."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tokenizers import AddedToken
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    CLIPVisionConfig,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3Processor,
    Gemma3TextConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextProcessor,
    LlavaProcessor,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    SiglipVisionConfig,
)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from engine.multimodal.families import split_images
from engine.multimodal.inputs import ImageInput
from server.openai.images import model_processor
from tests.model_factory import build_tokenizer

LLAVA_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n{% elif c['type'] == 'text' %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
"""LLaVA-1.5's layout (an `<image>` line where each image goes), in the locally trained tokenizer's words."""

IMAGE_SIZE = 28
PATCH_SIZE = 14
"""(28 / 14)^2 = 4 patches: 4 image tokens per image (LLaVA-1.5 drops the CLS position)."""


def _clip_config() -> CLIPVisionConfig:
    return CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32,
    )  # fmt: skip


def _llama_config(tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip


def build_llava_dir(directory: Path, seed: int = 0) -> Path:
    """A LLaVA-1.5 (CLIP vision tower, two-layer projector, Llama language model) with its LlavaProcessor."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(directory)
    tokenizer.add_tokens([AddedToken("<image>", normalized=False, special=True)], special_tokens=True)
    tokenizer.chat_template = LLAVA_TEMPLATE
    config = LlavaConfig(
        vision_config=_clip_config(),
        text_config=_llama_config(tokenizer),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(config).save_pretrained(directory)
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default", num_additional_image_tokens=1, chat_template=LLAVA_TEMPLATE,
    )  # fmt: skip
    processor.save_pretrained(directory)
    return directory


QWEN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
"""Qwen2-VL's layout (each image between vision start and end tokens), in the locally trained tokenizer's words."""

QWEN_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")


def build_qwen2_vl_dir(directory: Path, seed: int = 0, version: str = "2") -> Path:
    """A Qwen2-VL (`version` "2") or Qwen2.5-VL ("2.5"): a vision transformer at each image's own resolution
    (between 56x56 and 112x112 pixels here: 4 to 16 tokens), a Qwen2 language model with M-RoPE, and the model's
    PIL image processor (its processor class needs torchvision: server/openai/images.py GridProcessor)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(directory)
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=True) for t in QWEN_TOKENS], special_tokens=True)
    tokenizer.chat_template = QWEN_TEMPLATE
    tokenizer.save_pretrained(directory)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_TOKENS}
    text = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    shared = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    tokens = dict(
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    torch.manual_seed(seed)
    if version == "2":
        vision = dict(depth=2, embed_dim=32, num_heads=4, hidden_size=64, mlp_ratio=2, **shared)
        model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision, **tokens))
    else:
        vision = dict(depth=2, hidden_size=32, num_heads=4, intermediate_size=64, out_hidden_size=64,
                      fullatt_block_indexes=[1], window_size=56, **shared)  # fmt: skip
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens))
    model.save_pretrained(directory)
    Qwen2VLImageProcessorPil(
        min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, merge_size=2, temporal_patch_size=2
    ).save_pretrained(directory)
    return directory


GEMMA_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<start_of_image>{% elif c['type'] == 'text' %}"
    "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
"""Gemma 3's layout (`<start_of_image>` where each image goes), in the locally trained tokenizer's words."""

GEMMA_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}


def build_gemma3_dir(directory: Path, seed: int = 0) -> Path:
    """A Gemma 3 (SigLIP tower, pooling projector: 4 tokens per 28x28 image; Gemma 3's language model with a
    16-token sliding window in its local layers) with its Gemma3Processor."""
    directory.mkdir(parents=True, exist_ok=True)
    trained = build_tokenizer(directory)
    trained.add_tokens([AddedToken(t, normalized=False, special=True) for t in GEMMA_TOKENS.values()],
                       special_tokens=True)  # fmt: skip
    # The processor reads the image tokens as the tokenizer's named special tokens (`boi_token`, ...).
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=trained.backend_tokenizer, bos_token=trained.bos_token, eos_token=trained.eos_token,
        pad_token=trained.pad_token, extra_special_tokens=GEMMA_TOKENS,
    )  # fmt: skip
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in GEMMA_TOKENS.items()}
    text = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=16, initializer_range=0.3,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
    )  # fmt: skip
    config = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"], image_token_index=ids["image_token"],
    )  # fmt: skip
    torch.manual_seed(seed)
    Gemma3ForConditionalGeneration(config).save_pretrained(directory)
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    Gemma3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_length=4, chat_template=GEMMA_TEMPLATE
    ).save_pretrained(directory)
    return directory


def build_llava_next_dir(directory: Path, seed: int = 0) -> Path:
    """A LLaVA-NeXT: LLaVA's parts plus tiling (28x28 tiles in grids up to 2x2) and the learned row newline, with
    its LlavaNextProcessor: an image's token count follows its size."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(directory)
    tokenizer.add_tokens([AddedToken("<image>", normalized=False, special=True)], special_tokens=True)
    tokenizer.chat_template = LLAVA_TEMPLATE
    pinpoints = [[IMAGE_SIZE, IMAGE_SIZE], [IMAGE_SIZE, 2 * IMAGE_SIZE], [2 * IMAGE_SIZE, IMAGE_SIZE],
                 [2 * IMAGE_SIZE, 2 * IMAGE_SIZE]]  # fmt: skip
    config = LlavaNextConfig(
        vision_config=_clip_config(), text_config=_llama_config(tokenizer),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), image_grid_pinpoints=pinpoints,
        vision_feature_layer=-2, vision_feature_select_strategy="default",
    )  # fmt: skip
    torch.manual_seed(seed)
    LlavaNextForConditionalGeneration(config).save_pretrained(directory)
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_grid_pinpoints=pinpoints,
    )  # fmt: skip
    LlavaNextProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default", num_additional_image_tokens=1, chat_template=LLAVA_TEMPLATE,
    ).save_pretrained(directory)  # fmt: skip
    return directory


BUILDERS = {
    "llava_next": build_llava_next_dir,
    "gemma3": build_gemma3_dir,
    "llava": build_llava_dir,
    "qwen2_vl": build_qwen2_vl_dir,
    "qwen2_5_vl": lambda directory, seed=0: build_qwen2_vl_dir(directory, seed, version="2.5"),
}
"""Each tested image family's tiny model."""


def random_image(seed: int, width: int = 40, height: int = 30) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"


class Prompts:
    """Chat prompts with images through the model's processor, as the server makes them, and the model's own
    greedy generation over the same processed inputs (the oracle)."""

    def __init__(self, model_dir: Path) -> None:
        self.config = AutoConfig.from_pretrained(model_dir)
        self.processor = model_processor(str(model_dir), self.config)
        self.tokenizer = self.processor.tokenizer
        self.hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)

    def processed(self, content: list[dict], images: list[Image.Image]) -> dict:
        """The processor's output as the server gets it (numpy arrays)."""
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        return self.processor(text=text, images=images or None, return_tensors="np", add_special_tokens=False)

    def engine_inputs(self, content: list[dict], images: list[Image.Image]) -> tuple[list[int], list[ImageInput]]:
        out = self.processed(content, images)
        ids = [int(token) for token in out["input_ids"][0]]
        return ids, split_images(self.config, ids, out) if images else []

    @torch.no_grad()
    def prompt_logprobs(self, content: list[dict], images: list[Image.Image]) -> list[float]:
        """Each prompt token's logprob given the tokens before it, from the model's own forward pass (its own
        masks: Gemma 3's image tokens see each other both ways)."""
        out = {name: torch.as_tensor(np.asarray(value)) for name, value in self.processed(content, images).items()}
        logits = self.hf(**out).logits[0, :-1].float()
        targets = out["input_ids"][0, 1:]
        return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1).tolist()

    def generate(self, content: list[dict], images: list[Image.Image], max_new: int) -> tuple[list[int], list[float]]:
        """Greedy tokens and their logprobs from `generate` alone."""
        out = {name: torch.as_tensor(np.asarray(value)) for name, value in self.processed(content, images).items()}
        result = self.hf.generate(
            **out, max_new_tokens=max_new, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        generated = result.sequences[0, out["input_ids"].shape[1] :]
        steps = torch.log_softmax(torch.cat(result.logits).float(), dim=-1)
        return generated.tolist(), steps.gather(1, generated[:, None]).squeeze(1).tolist()
