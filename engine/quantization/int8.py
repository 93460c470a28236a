"""`--quantization int8` and `int8-dynamic`: int8 weights with a scale per output channel; and the int8 LM head
of every CPU scheme.

- `Int8LinearMethod` (weight-only): the kernel reads the int8 codes and widens them in registers; activations stay
  in the model's dtype. Decode reads every weight once a token, so a quarter of float32's bytes (half of
  bfloat16's) is where its speed comes from.
- `W8A8LinearMethod` (`int8-dynamic`): activations are quantized too, symmetric int8 with a scale per token taken
  at every step, and the products are integer dot products accumulated in int32 (VNNI where the CPU has it), then
  rescaled by both scales: prefill, which is bound by arithmetic rather than bytes, gains as well.
- `Int8HeadMethod`: the LM head of int8, int8-dynamic and int4 models, weight-only int8 per vocabulary row, as
  llama.cpp's Q8_0 keeps its output matrix (its Q4_0 files keep it at 6 bits): on a small model the head is a large
  part of the bytes a decode step reads (Qwen2.5-0.5B: 136M of its 494M parameters). A tied embedding reads its
  rows back from it (`embed_rows`).

The kernels and their layouts are engine/kernels/quant_linear.py's.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels import quant_linear
from engine.layers.linear_method import DecoderScheme, DecoderWeight
from engine.quantization.base import CheckpointQuantizedMethod, QuantizedLinearMethod, drop_parameters


class Int8LinearMethod(CheckpointQuantizedMethod):
    scheme = "int8"
    pack = staticmethod(quant_linear.pack_int8)
    """Codes and scales -> the kernel's layout."""
    linear = staticmethod(quant_linear.int8_linear)
    dequantize = staticmethod(quant_linear.dequantize_int8)
    decoder_scheme = DecoderScheme.INT8

    def parameter_specs(self, input_size: int, output_size: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"weight": ((output_size, input_size), torch.int8), "weight_scale": ((output_size,), torch.float32)}

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scale = quant_linear.symmetric_int8(weight)
        return {"weight": codes, "weight_scale": scale}

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.int8 = self.pack(layer.weight.detach(), layer.weight_scale.detach())
        drop_parameters(layer, ["weight", "weight_scale"])

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.linear(x, layer.int8, layer.output_size, bias)

    def decoder_weight(self, layer: nn.Module) -> DecoderWeight | None:
        return DecoderWeight(self.decoder_scheme, *layer.int8)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        return self.dequantize(layer.int8, layer.output_size, layer.input_size)


class W8A8LinearMethod(Int8LinearMethod):
    """The same codes and scales in the W8A8 kernel's layout, multiplied by activations it quantizes per token."""

    scheme = "int8-dynamic"
    pack = staticmethod(quant_linear.pack_w8a8)
    linear = staticmethod(quant_linear.w8a8_linear)
    dequantize = staticmethod(quant_linear.dequantize_w8a8)
    decoder_scheme = DecoderScheme.W8A8


class Int8HeadMethod(QuantizedLinearMethod):
    """The LM head in int8, quantized from its own (or the tied embedding's) matrix once loaded: a scale per
    vocabulary row, so a rank's rows quantize as they would in the whole matrix."""

    scheme = "int8"
    embeds_rows = True

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        with torch.no_grad():
            layer.int8 = quant_linear.quantize_int8(layer.weight.detach())
        layer.embed_dtype = layer.weight.dtype
        del layer.weight  # a tied embedding's matrix too: the embedding reads its rows from here from now on

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return quant_linear.int8_linear(x, layer.int8, layer.output_size, bias)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        return quant_linear.dequantize_int8(layer.int8, layer.output_size, layer.input_size)

    def embed_rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        rows = quant_linear.int8_rows(layer.int8, ids.reshape(-1), layer.input_size)  # [N, in]
        return rows.to(layer.embed_dtype).view(*ids.shape, layer.input_size)
