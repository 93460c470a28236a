"""`--quantization fp8`: e4m3 weights with a scale per output channel, multiplied by scaled matmuls.

Activations are quantized to e4m3 too, with a scale per token taken at every step, and `torch._scaled_mm` multiplies
the two in e4m3 with float32 accumulation and applies both scales on the way out (rowwise scaling): on a GPU with
fp8 tensor cores (compute capability 8.9 and up: Ada, Hopper) that is the fast path, half the weight bytes of
bfloat16 and twice its matrix rate. On a CPU the same call runs, slowly (torch widens the codes), and computes the
same products: the path the GPU takes, tested where there is no GPU.

`quantize_fp8` takes one whole checkpoint tensor `[out, in]` (before tensor parallelism slices it, so a rank's slice
of the codes and scales is what one rank would hold: engine/quantization/base.py) and computes in float32: `w ~
code * scale[row]`, `scale = absmax(row) / 448`, e4m3's largest finite value; a row of zeros gets scale 1, so
dequantizing gives the zeros back.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.quantization.base import CheckpointQuantizedMethod, drop_parameters

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448


CHUNK_ELEMENTS = 1 << 19
"""Weights quantized at a time: the float32 temporaries stay a few MiB, whatever the tensor (a load's peak memory
is the quantized model plus the checkpoint tensor in flight, not several float32 copies of it)."""


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[out, in]` -> (float8_e4m3fn codes `[out, in]`, float32 scales `[out]`), a chunk of rows at a time."""
    out_features, in_features = weight.shape
    codes = torch.empty(out_features, in_features, dtype=FP8_DTYPE)
    scale = torch.empty(out_features)
    step = max(1, CHUNK_ELEMENTS // max(in_features, 1))
    for start in range(0, out_features, step):
        rows = weight[start : start + step].to(torch.float32, copy=True)  # [r, in], never the caller's own
        absmax = rows.abs().amax(dim=1)  # [r]
        row_scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
        codes[start : start + step] = rows.div_(row_scale[:, None]).clamp_(-FP8_MAX, FP8_MAX)  # RNE on the copy
        scale[start : start + step] = row_scale
    return codes, scale


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale[:, None]


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations `[N, in]` -> (e4m3 `[N, in]`, float32 scales `[N, 1]`): a scale per token, taken at every step
    (dynamic), as vLLM's fp8 does."""
    scale = x.float().abs().amax(dim=1, keepdim=True).clamp_(min=1e-12) / FP8_MAX  # [N, 1]
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


ALIGNMENT = 16
"""`_scaled_mm` on CUDA takes matrices whose inner and output sizes are multiples of 16."""


class Fp8LinearMethod(CheckpointQuantizedMethod):
    scheme = "fp8"

    def parameter_specs(self, input_size: int, output_size: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"weight": ((output_size, input_size), FP8_DTYPE), "weight_scale": ((output_size,), torch.float32)}

    def refuses(self, input_size: int, output_size: int) -> str | None:
        if input_size % ALIGNMENT or output_size % ALIGNMENT:
            return f"scaled matmuls take sizes that are multiples of {ALIGNMENT}"
        return None

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scale = quantize_fp8(weight)
        return {"weight": codes, "weight_scale": scale}

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # `_scaled_mm` takes its second matrix column-major: `[out, in]` row-major, transposed, is.
        layer.fp8_weight = layer.weight.detach()  # [out, in]
        layer.fp8_scale = layer.weight_scale.detach().view(1, -1)  # [1, out]
        layer.fp8_unit = torch.ones((), device=layer.fp8_scale.device)
        drop_parameters(layer, ["weight", "weight_scale"])

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [N, in]
        codes, scale = quantize_fp8_rows(rows)  # [N, in] e4m3, [N, 1]
        if x.dtype == torch.float32 and x.device.type == "cuda":
            # CUDA's rowwise scaling writes bfloat16 only: a float32 model takes the float32 sums of unit-scaled
            # products and applies both scales itself (the same products, the same float32 accumulation).
            out = torch._scaled_mm(
                codes, layer.fp8_weight.t(), scale_a=layer.fp8_unit, scale_b=layer.fp8_unit, out_dtype=torch.float32
            )  # [N, out]
            out = out * scale * layer.fp8_scale
            if bias is not None:
                out += bias
        else:
            out = torch._scaled_mm(
                codes, layer.fp8_weight.t(), scale_a=scale, scale_b=layer.fp8_scale, bias=bias, out_dtype=x.dtype
            )  # [N, out]
        return out.view(*x.shape[:-1], out.shape[-1])

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        return dequantize_fp8(layer.fp8_weight, layer.fp8_scale.view(-1))
