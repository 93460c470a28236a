"""GGUF files' quantized linears kept quantized: Q4_0 on the int4 kernel (engine/kernels/quant_linear.py).

A Q4_0 block is 32 inputs of one row, `w = d * (q - 8)` with q in 0..15 and d the block's float16 scale: exactly
the int4 layout's `min + scale * code` in groups of 32, with scale |d| and min -8d (d < 0: codes 15 - q, min 7d).
The file's weights reach the layer dequantized (engine/models/gguf.py), which float32 holds exactly; the blocks are
read back from them: llama.cpp quantizes a block so that its value of largest magnitude is -8d, so d is that value
over -8 and every q follows. The one difference from the file: the int4 layout keeps scales and minimums in
bfloat16, so each block's d is rounded to bfloat16 (a relative error of at most 2^-8, half its last place), and
where d < 0 its minimum (-7 times it) once more: a weight moves by at most 15 * 2^-8 of its block's |d|.
A layer whose blocks are not all of that form (a file quantized another way) is
quantized from its weights as `--quantization int4` would, with a warning.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.kernels import quant_linear
from engine.models.gguf import Q4_0_BLOCK
from engine.quantization.int4 import Int4LinearMethod

logger = logging.getLogger(__name__)


def q4_0_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A dequantized Q4_0 weight `[out, in]` as (codes `[out, in]` uint8, scales, mins `[out, in / 32]` float32,
    the scales rounded to bfloat16) with `mins + scales * codes` equal to it but for that rounding; None when a
    block is not `d * (q - 8)` for one d."""
    out_features, in_features = weight.shape
    blocks = weight.float().reshape(out_features, in_features // Q4_0_BLOCK, Q4_0_BLOCK)
    extreme = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))  # -8 d
    d = extreme / -8
    steps = blocks / torch.where(d == 0, 1, d)  # q - 8, exactly, for a block of that form
    if not torch.equal(steps, steps.round()) or steps.min() < -8 or steps.max() > 7:
        return None
    negative = d < 0
    codes = torch.where(negative, 7 - steps, steps + 8).to(torch.uint8)
    # The minimum from the scale as the layout keeps it (bfloat16): -8 times it is exact, so a block with d > 0
    # is off by its scale's rounding alone, (q - 8) times it.
    scales = d.abs()[..., 0].to(torch.bfloat16).float()
    mins = torch.where(negative[..., 0], -7 * scales, -8 * scales)
    return codes.reshape(out_features, in_features), scales, mins


class GGUFQ4_0Method(Int4LinearMethod):
    """`int4` in groups of 32 whose codes are the Q4_0 file's own (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__(Q4_0_BLOCK)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        with torch.no_grad():
            blocks = q4_0_blocks(layer.weight.detach())
            if blocks is None:
                logger.warning(
                    "a %d x %d layer's weights are not Q4_0 blocks of the usual form: quantized to int4 again",
                    layer.output_size,
                    layer.input_size,
                )
                layer.int4 = quant_linear.quantize_int4(layer.weight.detach(), Q4_0_BLOCK)
            else:
                layer.int4 = quant_linear.pack_int4(*blocks)
        del layer.weight
