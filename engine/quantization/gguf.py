"""GGUF files' quantized linears kept quantized: Q4_0 on the int4 kernel, Q8_0 on the grouped int8 kernel
(engine/kernels/quant_linear.py), and a Q8_0 LM head (and the tied embedding it shares) on the latter too.

A Q4_0 block is 32 inputs of one row, `w = d * (q - 8)` with q in 0..15 and d the block's float16 scale; a Q8_0
block `w = d * q` with q in -127..127. Both are the grouped layouts' `min + scale * code` in groups of 32: scale d
and min -8d (Q4_0; a negative d is a negative scale, which the kernel multiplies as any), or codes q + 128 and min
-128d (Q8_0). The kernels keep scales and minimums in float16, which holds d and -8d or -128d exactly: the layers
compute with the file's weights.

The file's weights reach the layer dequantized (engine/models/gguf.py), which float32 holds exactly; the blocks are
read back from them: llama.cpp quantizes a Q4_0 block so that its value of largest magnitude is -8d, a Q8_0 block so
that it is 127d or -127d; so d is that value over -8, or its magnitude over 127, and every q follows. A layer whose
blocks are not all of that form (a file quantized another way, or weights rounded to bfloat16 by `--dtype`) is
quantized from its weights as llama.cpp quantizes such a block, with a warning.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.kernels import quant_linear
from engine.layers.linear_method import DecoderWeight
from engine.models.gguf import BLOCK
from engine.quantization.base import QuantizedLinearMethod
from engine.quantization.grouped import grouped_decoder_weight

logger = logging.getLogger(__name__)


def q4_0_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A dequantized Q4_0 weight `[out, in]` as (codes `[out, in]` uint8, scales, mins `[out, in / 32]` float32)
    with `mins + scales * codes` equal to it; None when a block is not `d * (q - 8)` for one float16 d."""
    blocks = _blocks(weight)
    d = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True)) / -8  # [out, in / 32, 1]
    steps = blocks / torch.where(d == 0, 1, d)  # q - 8, exactly, for a block of that form
    if not _on_grid(steps, d, -8, 7):
        return None
    return (steps + 8).to(torch.uint8).flatten(1), d[..., 0], -8 * d[..., 0]


def q8_0_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A dequantized Q8_0 weight `[out, in]` as (codes q + 128 `[out, in]` uint8, scales, mins `[out, in / 32]`
    float32) with `mins + scales * codes` equal to it; None when a block is not `d * q` for one float16 d."""
    blocks = _blocks(weight)
    d = blocks.abs().amax(-1, keepdim=True) / 127  # [out, in / 32, 1]
    steps = blocks / torch.where(d == 0, 1, d)
    if not _on_grid(steps, d, -127, 127):
        return None
    return (steps + 128).to(torch.uint8).flatten(1), d[..., 0], -128 * d[..., 0]


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`[out, in]` float weights quantized as llama.cpp's Q8_0 quantizes them (d = max |w| / 127, q = w times 1 / d
    rounded half away from zero, then d rounded to float16), in `q8_0_blocks`' form."""
    blocks = _blocks(weight)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    scaled = blocks * torch.where(d == 0, 0, 1 / d)  # llama.cpp multiplies by the reciprocal
    q = scaled.abs().add(0.5).floor().copysign(scaled)  # roundf: halves away from zero
    d = d.to(torch.float16).float()
    return (q + 128).to(torch.uint8).flatten(1), d[..., 0], -128 * d[..., 0]


def quantize_q4_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`[out, in]` float weights quantized as llama.cpp's Q4_0 quantizes them (d = the block's value of largest
    magnitude over -8, q = trunc(w / d + 8.5) at most 15, d then rounded to float16), in `q4_0_blocks`' form."""
    blocks = _blocks(weight)
    d = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True)) / -8
    q = (blocks * torch.where(d == 0, 0, 1 / d) + 8.5).floor().clamp(0, 15)  # w / d >= -8: truncation is the floor
    d = d.to(torch.float16).float()
    return q.to(torch.uint8).flatten(1), d[..., 0], -8 * d[..., 0]


def _blocks(weight: torch.Tensor) -> torch.Tensor:
    out_features, in_features = weight.shape
    return weight.float().reshape(out_features, in_features // BLOCK, BLOCK)


def _on_grid(steps: torch.Tensor, d: torch.Tensor, low: int, high: int) -> bool:
    """Whether every block is whole multiples of a float16 d within [low, high]."""
    return (
        torch.equal(steps, steps.round())
        and bool(steps.min() >= low)
        and bool(steps.max() <= high)
        and torch.equal(d.to(torch.float16).float(), d)
    )


class _FileCodesMethod(QuantizedLinearMethod):
    """A layer loaded dequantized (float32, whatever `--dtype`: its weights must stay on the file's grid) whose
    blocks are read back once its last shard is in. A block never straddles a rank's slice (the layer's inputs per
    rank are whole blocks: `refuses`), so each rank reads back its slice of the file's blocks."""

    kind: str
    bits: int

    def refuses(self, input_size: int, output_size: int) -> str | None:
        if input_size % BLOCK:
            return f"its inputs do not divide into {self.kind} blocks of {BLOCK}"
        return None

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, bias: bool, dtype: torch.dtype
    ) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)  # float32
        layer.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False) if bias else None
        layer.embed_dtype = dtype  # a tied embedding's rows, read back from here

    def read_back(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        raise NotImplementedError

    def requantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        with torch.no_grad():
            weight = layer.weight.detach()
            blocks = self.read_back(weight)
            if blocks is None:
                logger.warning(
                    "a %d x %d layer's weights are not %s blocks of the usual form: quantized again as llama.cpp would",
                    layer.output_size,
                    layer.input_size,
                    self.kind,
                )
                blocks = self.requantize(weight)
            layer.grouped = quant_linear.GROUPED[self.bits].pack(*blocks, torch.float16)
        del layer.weight

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return quant_linear.GROUPED[self.bits].linear(x, layer.grouped, layer.output_size, bias)

    def decoder_weight(self, layer: nn.Module) -> DecoderWeight | None:
        return grouped_decoder_weight(self.bits, layer.grouped)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        return quant_linear.GROUPED[self.bits].dequantize(layer.grouped, layer.output_size, layer.input_size)


class GGUFQ4_0Method(_FileCodesMethod):
    """The Q4_0 file's own codes on the int4 kernel (see the module's docstring)."""

    scheme = "int4"
    kind = "Q4_0"
    bits = 4
    read_back = staticmethod(q4_0_blocks)
    requantize = staticmethod(quantize_q4_0)


class GGUFQ8_0Method(_FileCodesMethod):
    """The Q8_0 file's own codes on the grouped int8 kernel; its LM head's too, and a tied embedding's rows read
    back from there (see the module's docstring)."""

    scheme = "int8"
    kind = "Q8_0"
    bits = 8
    embeds_rows = True
    read_back = staticmethod(q8_0_blocks)
    requantize = staticmethod(quantize_q8_0)

    def embed_rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        rows = quant_linear.int8_group_rows(layer.grouped, ids.reshape(-1), layer.input_size)  # [N, in]
        return rows.to(layer.embed_dtype).view(*ids.shape, layer.input_size)
