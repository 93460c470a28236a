"""gpt-oss checkpoints with MXFP4 experts, packed here (no quantization tool involved) from a tiny saved model.

MXFP4 as gpt-oss stores it: each expert matrix `[experts, out, in]` (the in-memory `[experts, in, out]` transposed)
in blocks of 32 inputs, each block 16 bytes of FP4 (e2m1) codes, the even input in the low nibble, and one byte of
shared exponent (e8m0, bias 127). The packer draws codes and exponents, so the dequantized weights are exact in
float32: the same values go into a plain checkpoint beside it, the oracle's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The e2m1 value of each 4-bit code (sign in the high bit)."""
BLOCK = 32
PROJECTIONS = ("gate_up_proj", "down_proj")


def pack(codes: torch.Tensor, exponents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`codes` `[..., in]` (0-15) and `exponents` `[..., in / 32]` (unbiased) -> (blocks `[..., in / 32, 16]` uint8,
    scales `[..., in / 32]` uint8)."""
    grouped = codes.to(torch.uint8).unflatten(-1, (-1, BLOCK))  # [..., in / 32, 32]
    blocks = grouped[..., 0::2] | (grouped[..., 1::2] << 4)
    return blocks, (exponents + 127).to(torch.uint8)


def dequantize(codes: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """The float32 weights `[..., in]` the codes and exponents stand for."""
    values = torch.tensor(FP4_VALUES)[codes.long()]  # [..., in]
    scale = torch.ldexp(torch.ones(()), exponents.float()).repeat_interleave(BLOCK, dim=-1)
    return values * scale


def write_mxfp4_pair(plain_dir: Path, mxfp4_dir: Path, seed: int = 0) -> None:
    """From the gpt-oss model in `plain_dir`: draw each expert matrix as MXFP4, write the dequantized values back into
    `plain_dir` and the packed blocks and scales (with config.json's `quantization_config`) into `mxfp4_dir`."""
    generator = torch.Generator().manual_seed(seed)
    shutil.copytree(plain_dir, mxfp4_dir)
    tensors = load_file(plain_dir / "model.safetensors")
    plain, packed = dict(tensors), {}
    for name, tensor in tensors.items():
        if not name.endswith(PROJECTIONS):
            packed[name] = tensor
            continue
        experts, inputs, outputs = tensor.shape  # in memory: [experts, in, out]
        codes = torch.randint(0, 16, (experts, outputs, inputs), generator=generator)
        exponents = torch.randint(-4, 0, (experts, outputs, inputs // BLOCK), generator=generator)
        plain[name] = dequantize(codes, exponents).transpose(1, 2).contiguous()
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = pack(codes, exponents)
    save_file(plain, plain_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(packed, mxfp4_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((mxfp4_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
    }  # fmt: skip
    (mxfp4_dir / "config.json").write_text(json.dumps(config, indent=2))
