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
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
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


def build_llava_dir(directory: Path, seed: int = 0) -> Path:
    """A LLaVA-1.5 (CLIP vision tower, two-layer projector, Llama language model) with its LlavaProcessor."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(directory)
    tokenizer.add_tokens([AddedToken("<image>", normalized=False, special=True)], special_tokens=True)
    tokenizer.chat_template = LLAVA_TEMPLATE
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32,
    )  # fmt: skip
    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
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


BUILDERS = {
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

    def generate(self, content: list[dict], images: list[Image.Image], max_new: int) -> tuple[list[int], list[float]]:
        """Greedy tokens and their logprobs from `generate` alone."""
        out = {name: torch.as_tensor(np.asarray(value)) for name, value in self.processed(content, images).items()}
        result = self.hf.generate(
            **out, max_new_tokens=max_new, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        generated = result.sequences[0, out["input_ids"].shape[1] :]
        steps = torch.log_softmax(torch.cat(result.logits).float(), dim=-1)
        return generated.tolist(), steps.gather(1, generated[:, None]).squeeze(1).tolist()
