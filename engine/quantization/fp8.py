"""`--quantization fp8`: e4m3 weights with a scale per output channel, multiplied by scaled matmuls.

Activations are quantized to e4m3 too, with a scale per token taken at every step, and `torch._scaled_mm` multiplies
the two in e4m3 with float32 accumulation and applies both scales on the way out (rowwise scaling): on a GPU with
fp8 tensor cores (compute capability 8.9 and up: Ada, Hopper) that is the fast path, half the weight bytes of
bfloat16 and twice its matrix rate. On a CPU the same call runs, slowly (torch widens the codes), and computes the
same products: the path the GPU takes, tested where there is no GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.quantization.base import CheckpointQuantizedMethod, drop_parameters
from engine.quantization.codes import FP8_DTYPE, dequantize_fp8, quantize_fp8, quantize_fp8_rows

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
