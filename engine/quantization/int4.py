"""`--quantization int4`: 4-bit weights in groups along the input, a scale and a minimum per group.

`w ~ min + scale * code` with codes in [0, 15] (engine/kernels/quant_linear.py's `quantize_int4`): the kernel reads
two codes a byte and widens them in registers, so decode reads about a quarter of bfloat16's bytes, plus each
group's bfloat16 scale and minimum. Groups of 32 to 128 inputs (--quantization-group-size): the smaller, the closer
to the weights and the more bytes of scales.

Quantized from the layer's own weight once its last shard is in: a group lies within one row and never straddles a
row-parallel split (a rank's inputs must divide into groups: `refuses`), so each rank's codes are its slice of the
one-rank model's.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels import quant_linear
from engine.layers.linear_method import DecoderScheme, DecoderWeight
from engine.quantization.base import QuantizedLinearMethod


class Int4LinearMethod(QuantizedLinearMethod):
    scheme = "int4"

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def refuses(self, input_size: int, output_size: int) -> str | None:
        if input_size % self.group_size:
            return f"its inputs do not divide into int4 groups of {self.group_size} (--quantization-group-size)"
        return None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        with torch.no_grad():
            layer.int4 = quant_linear.quantize_int4(layer.weight.detach(), self.group_size)
        del layer.weight

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return quant_linear.int4_linear(x, layer.int4, layer.output_size, bias)

    def decoder_weight(self, layer: nn.Module) -> DecoderWeight | None:
        return DecoderWeight(DecoderScheme.INT4, *layer.int4)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        return quant_linear.dequantize_int4(layer.int4, layer.output_size, layer.input_size)
