"""Quantizing a weight matrix per output channel: from float weights to the codes and scales that int8,
int8-dynamic and fp8 keep (int4's groups are quantized by its kernel's module, engine/kernels/quant_linear.py).

Each function takes one whole checkpoint tensor `[out, in]` (before tensor parallelism slices it, so a rank's slice
of the codes and scales is what one rank would hold: engine/quantization/base.py) and computes in float32:

- int8, symmetric: `w ~ code * scale[row]`, codes in [-127, 127] (-128 unused, so negating a code never
  overflows), `scale = absmax(row) / 127`.
- fp8 (e4m3): `w ~ code * scale[row]`, `scale = absmax(row) / 448`, e4m3's largest finite value.

A row of zeros gets scale 1, so dequantizing never divides by zero and gives the zeros back.
"""

from __future__ import annotations

import torch

INT8_MAX = 127
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448


CHUNK_ELEMENTS = 1 << 19
"""Weights quantized at a time: the float32 temporaries stay a few MiB, whatever the tensor (a load's peak memory
is the quantized model plus the checkpoint tensor in flight, not several float32 copies of it)."""


def _scale(span: torch.Tensor, levels: float) -> torch.Tensor:
    return torch.where(span > 0, span / levels, torch.ones_like(span))


def _per_row(
    weight: torch.Tensor, levels: float, code_dtype: torch.dtype, round_codes: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric codes with a scale per row, `levels` at the row's largest magnitude, a chunk of rows at a time."""
    out_features, in_features = weight.shape
    codes = torch.empty(out_features, in_features, dtype=code_dtype)
    scale = torch.empty(out_features)
    step = max(1, CHUNK_ELEMENTS // max(in_features, 1))
    for start in range(0, out_features, step):
        rows = weight[start : start + step].to(torch.float32, copy=True)  # [r, in], never the caller's own
        row_scale = _scale(rows.abs().amax(dim=1), levels)  # [r]
        scaled = rows.div_(row_scale[:, None])
        if round_codes:
            scaled.round_()
        codes[start : start + step] = scaled.clamp_(-levels, levels)  # cast on copy: exact for int8, RNE for e4m3
        scale[start : start + step] = row_scale
    return codes, scale


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[out, in]` -> (int8 codes `[out, in]`, float32 scales `[out]`)."""
    return _per_row(weight, INT8_MAX, torch.int8, round_codes=True)


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale[:, None]


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[out, in]` -> (float8_e4m3fn codes `[out, in]`, float32 scales `[out]`)."""
    return _per_row(weight, FP8_MAX, FP8_DTYPE, round_codes=False)


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale[:, None]


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations `[N, in]` -> (e4m3 `[N, in]`, float32 scales `[N, 1]`): a scale per token, taken at every step
    (dynamic), as vLLM's fp8 does."""
    scale = x.float().abs().amax(dim=1, keepdim=True).clamp_(min=1e-12) / FP8_MAX  # [N, 1]
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
