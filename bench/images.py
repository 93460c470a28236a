"""`ferry bench images`: image questions offline, Ferry against transformers' `generate` and vLLM.

Each request is a short question (random token ids) about one image (random pixels, `--image-size` square), then
`--output-len` tokens greedy with EOS ignored. The model is a named image architecture with random weights, saved
once so every system runs the same weights (with a tokenizer and the family's image processor, as vLLM's
multimodal processing needs them): `llava-1.5-7b-v8-t2` (LLaVA-1.5-7B: CLIP ViT-L/14-336 cut to 8 of its 24
layers, Llama-7B to 2 of 32) and `qwen2-vl-2b-v8-t4` (Qwen2-VL-2B: vision 8 of 32 layers, language 4 of 28).

Systems: `ferry` (the engine in this process: prompts hold each image's tokens, the images go in processed),
`transformers` (one padded `generate` over every request: transformers has no continuous batching for image
models), `vllm` (its offline engine in its own interpreter, `--vllm-python`, given each image as a picture and
the prompt with one placeholder per image, which its processor expands). `--distinct-images K` (K < requests)
repeats K images across the requests with the question before the image, so no cached prefix holds an image and
Ferry's encoder cache is what saves the encodings.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from tokenizers import AddedToken
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForImageTextToText,
    AutoTokenizer,
    CLIPImageProcessor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from bench.vllm_baseline import KV_CACHE_GIB
from engine.api import generate_batch
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.request import SamplingParams
from engine.multimodal.families import image_token_id, split_images, tokens_per_grid
from engine.multimodal.inputs import ImageInput

TOKENIZER = Path(__file__).resolve().parents[1] / "server" / "default_model"
"""The demo model's tokenizer, with the family's image tokens added: the prompts are ids, it is only read by
processors."""
VLLM_RUNNER = Path(__file__).with_name("vllm_images.py")
INIT_STD = 0.02

IMAGE_SHAPES: dict[str, dict[str, Any]] = {
    "llava-1.5-7b-v8-t2": {
        "model_type": "llava",
        "vision_config": dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096,
                              num_hidden_layers=8, num_attention_heads=16, image_size=336, patch_size=14,
                              projection_dim=768),
        "text_config": dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=2,
                            num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
                            max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "tokens": ("<image>",),
    },
    "qwen2-vl-2b-v8-t4": {
        "model_type": "qwen2_vl",
        "vision_config": dict(depth=8, embed_dim=1280, num_heads=16, hidden_size=1536, mlp_ratio=4, patch_size=14,
                              spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        "text_config": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=4, num_attention_heads=12,
                            num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                                             "mrope_section": [16, 24, 24]},
                            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        "tokens": ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"),
    },
}  # fmt: skip


@dataclass
class ImageWorkload:
    """Per request: the prompt as Ferry and transformers take it (each image's tokens in place), as vLLM takes it
    (one placeholder per image), and its image."""

    ferry_prompts: list[list[int]]
    vllm_prompts: list[list[int]]
    images: list[Image.Image]
    processed: list[list[ImageInput]]
    output_len: int


def prepare_image_model(name: str, workdir: Path, dtype: torch.dtype, seed: int = 0) -> Path:
    """Write the named shape's random weights, tokenizer and image processor into `workdir/name`."""
    spec = dict(IMAGE_SHAPES[name])
    path = workdir / name
    if (path / "config.json").is_file():
        return path
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    tokens = spec.pop("tokens")
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=True) for t in tokens], special_tokens=True)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in tokens}
    model_type = spec.pop("model_type")
    if model_type == "llava":
        config = AutoConfig.for_model("llava", image_token_id=ids["<image>"], **spec)
        processor = CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    else:
        config = AutoConfig.for_model(
            "qwen2_vl", image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"], **spec,
        )  # fmt: skip
        processor = Qwen2VLImageProcessorPil()
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, INIT_STD)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def make_workload(
    path: Path, num_requests: int, image_size: int, question_len: int, output_len: int, distinct: int, seed: int
) -> ImageWorkload:
    config = AutoConfig.from_pretrained(path)
    processor = AutoImageProcessor.from_pretrained(path)
    image_token = image_token_id(config)
    rng = np.random.default_rng(seed)
    pictures = [
        Image.fromarray(rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8)) for _ in range(distinct)
    ]
    vocab = min(int(config.text_config.vocab_size), 4000)
    ferry_prompts, vllm_prompts, images, processed = [], [], [], []
    for i in range(num_requests):
        picture = pictures[i % distinct]
        arrays = dict(processor(images=[picture], return_tensors="np"))
        question = rng.integers(10, vocab, question_len).tolist()
        if config.model_type == "qwen2_vl":
            count = tokens_per_grid(config, arrays["image_grid_thw"][0])
            before, after = [config.vision_start_token_id], [config.vision_end_token_id]
        else:
            count = (config.vision_config.image_size // config.vision_config.patch_size) ** 2
            before, after = [], []
        # The question first: requests sharing an image share no prefix that holds it.
        ferry = [1, *question, *before, *[image_token] * count, *after, 13]
        ferry_prompts.append(ferry)
        vllm_prompts.append([1, *question, *before, image_token, *after, 13])
        images.append(picture)
        processed.append(split_images(config, ferry, arrays))
    return ImageWorkload(ferry_prompts, vllm_prompts, images, processed, output_len)


def run_ferry(
    path: Path, workload: ImageWorkload, warm: ImageWorkload, dtype: str, max_batch_tokens: int
) -> tuple[float, list, dict]:
    config = EngineConfig.of(model=str(path), device="cpu", dtype=dtype, max_batch_tokens=max_batch_tokens,
                             max_num_seqs=len(workload.ferry_prompts), cpu_kv_cache_gib=4.0)  # fmt: skip
    engine = EngineCore(config)
    params = SamplingParams(max_new_tokens=workload.output_len, ignore_eos=True)
    generate_batch(warm.ferry_prompts, engine=engine, params=params, images=warm.processed)
    assert engine.encoder_cache is not None
    hits, misses = engine.encoder_cache.hits, engine.encoder_cache.misses
    start = time.perf_counter()
    outputs = generate_batch(workload.ferry_prompts, engine=engine, params=params, images=workload.processed)
    wall = time.perf_counter() - start
    tokens = [outputs[f"req_{i}"].generated_ids for i in range(len(workload.ferry_prompts))]
    cache = {"encoded": engine.encoder_cache.misses - misses, "encoder_cache_hits": engine.encoder_cache.hits - hits}
    engine.close()
    return wall, tokens, cache


@torch.no_grad()
def run_transformers(path: Path, workload: ImageWorkload, dtype: torch.dtype) -> tuple[float, list]:
    """One padded `generate` over every request (left padding): its batched image path."""
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval()
    config = model.config
    prompts = workload.ferry_prompts
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    arrays = [image.data for images in workload.processed for image in images]

    def rows(n: int) -> dict[str, torch.Tensor]:
        """The first n requests' inputs (each request holds one image)."""
        inputs = {"input_ids": input_ids[:n], "attention_mask": mask[:n]}
        if config.model_type == "qwen2_vl":
            inputs["pixel_values"] = torch.from_numpy(np.concatenate([a["pixel_values"] for a in arrays[:n]]))
            inputs["image_grid_thw"] = torch.from_numpy(np.stack([a["image_grid_thw"] for a in arrays[:n]]))
            inputs["mm_token_type_ids"] = (input_ids[:n] == config.image_token_id).long()
        else:
            inputs["pixel_values"] = torch.from_numpy(np.stack([a["pixel_values"] for a in arrays[:n]]))
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        return inputs

    model.generate(**rows(2), max_new_tokens=2, do_sample=False)  # warm-up
    options = dict(max_new_tokens=workload.output_len, min_new_tokens=workload.output_len, do_sample=False)
    start = time.perf_counter()
    out = model.generate(**rows(len(prompts)), **options)
    wall = time.perf_counter() - start
    return wall, out[:, width:].tolist()


def run_vllm(
    python: Path, path: Path, workload: ImageWorkload, dtype: str, max_batch_tokens: int
) -> tuple[float, list]:
    with tempfile.TemporaryDirectory(prefix="ferry-vllm-images-") as tmp:
        image_paths = []
        for i, image in enumerate(workload.images):
            image_path = Path(tmp) / f"{i}.png"
            image.save(image_path)
            image_paths.append(str(image_path))
        job = {
            "model": str(path), "dtype": dtype, "prompts": workload.vllm_prompts, "images": image_paths,
            "output_len": workload.output_len, "max_num_seqs": len(workload.vllm_prompts),
            "max_num_batched_tokens": max_batch_tokens, "max_model_len": 4096,
        }  # fmt: skip
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB), "HF_HUB_OFFLINE": "1"}
        subprocess.run([str(python), "-P", str(VLLM_RUNNER), str(job_path), str(out_path)], env=env, check=True)
        result = json.loads(out_path.read_text())
    return result["wall_seconds"], result["tokens"]


def run_images(args: Any) -> dict[str, Any]:
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    workdir = Path(args.workdir)
    path = prepare_image_model(args.model, workdir, torch_dtype)
    distinct = args.distinct_images or args.num_requests
    workload = make_workload(path, args.num_requests, args.image_size, args.question_len, args.output_len,
                             distinct, args.seed)  # fmt: skip
    warm = make_workload(path, 2, args.image_size, args.question_len, 4, 2, args.seed + 1)  # other images
    results: dict[str, Any] = {
        "model": args.model, "requests": args.num_requests, "image_size": args.image_size,
        "distinct_images": distinct, "output_len": args.output_len, "dtype": args.dtype,
        "prompt_tokens": len(workload.ferry_prompts[0]), "systems": {},
    }  # fmt: skip
    generated = args.num_requests * args.output_len
    outputs: dict[str, list] = {}
    for system in args.systems.split(","):
        cache: dict[str, int] = {}
        if system == "ferry":
            wall, outputs[system], cache = run_ferry(path, workload, warm, args.dtype, args.max_batch_tokens)
        elif system == "transformers":
            wall, outputs[system] = run_transformers(path, workload, torch_dtype)
        elif system == "vllm":
            if args.vllm_python is None:
                raise ValueError("--systems vllm needs --vllm-python")
            wall, outputs[system] = run_vllm(Path(args.vllm_python), path, workload, args.dtype, args.max_batch_tokens)
        else:
            raise ValueError(f"unknown system {system!r} (ferry, transformers, vllm)")
        run: dict[str, Any] = {"wall_seconds": wall, "tokens_per_second": generated / wall, **cache}
        if "ferry" in outputs and system != "ferry":
            # Same weights, greedy: requests whose tokens equal Ferry's (bf16 rounding may part them late).
            run["same_tokens_as_ferry"] = sum(a == b for a, b in zip(outputs[system], outputs["ferry"], strict=True))
        results["systems"][system] = run
    return results


def format_images(report: dict[str, Any]) -> str:
    lines = [
        f"{report['model']}: {report['requests']} requests, one {report['image_size']}x{report['image_size']} image "
        f"each ({report['distinct_images']} distinct), {report['prompt_tokens']} prompt tokens, "
        f"{report['output_len']} output tokens, {report['dtype']}",
        f"{'system':<14}{'wall s':>9}{'tok/s':>9}",
    ]
    for system, run in report["systems"].items():
        extra = ""
        if "encoded" in run:
            extra = f"  encoded {run['encoded']}, encoder-cache hits {run['encoder_cache_hits']}"
        if "same_tokens_as_ferry" in run:
            extra = f"  {run['same_tokens_as_ferry']}/{report['requests']} requests' tokens equal Ferry's"
        lines.append(f"{system:<14}{run['wall_seconds']:>9.2f}{run['tokens_per_second']:>9.1f}{extra}")
    return "\n".join(lines)
