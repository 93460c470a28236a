"""A quantized checkpoint's 4- and 8-bit weights in groups, kept as the checkpoint's own codes on the int4 and
grouped int8 kernels.

GPTQ, AWQ and compressed-tensors' `pack-quantized` store `w = scale * (q - zero)` with q a 4- or 8-bit code and a
scale and a zero point per (output row, group of inputs), each in a packing of its own. A `CodeLayout`
(engine/quantization/gptq.py, awq.py, compressed_tensors.py) unpacks a checkpoint's tensors into the form every
format shares, each tensor whole as it loads (so tensor parallelism slices codes, scales and zero points alike):

- `codes` `[out, in]` uint8, 0..15 (0..255 for 8 bits);
- `scales`, `zeros` `[out, groups]` float32 (`[out]` for a scale per output row, which a row-parallel split keeps
  whole on every rank);
- `g_idx` `[in]` int32, each input's group, only for a GPTQ checkpoint quantized in activation order (`desc_act`).

The kernels (engine/kernels/quant_linear.py) compute `min + scale * q` with min `-scale * zero`: int4 in groups of
32, 64 or 128 (a group of 256, or a scale per row, is the same scale repeated over groups of 128: exact), int8 in
groups of any multiple of 4. They keep scales and minimums in float16 or bfloat16: float16 where it holds every
scale of the layer's slice exactly (GPTQ's float16 scales, and bfloat16 ones within its range), so the scales are
the checkpoint's, and only a minimum that float16 cannot hold is rounded: by at most 2^-11 of |zero| scales
(symmetric groups' are exact: -8 or -128 scales). Elsewhere (float32 scales, or bfloat16 ones below float16's
range) bfloat16: scales rounded by up to 2^-9 of themselves and minimums by 2^-9 of |zero| scales, and, the choice
being each rank's, two ranks of one layer may keep different ones. An activation-order checkpoint's groups are
scattered over the inputs: sorting the inputs by group makes them contiguous (each group keeps its `group_size`
inputs), and each step's activations are gathered in that order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from engine.kernels import quant_linear
from engine.layers.linear_method import DecoderScheme, DecoderWeight
from engine.quantization.base import QuantizedLinearMethod, drop_parameters


class CodeLayout(Protocol):
    """How a checkpoint format stores a layer's codes, scales and zero points."""

    format: str
    """The format's name, as errors and the model card give it."""
    bits: int
    """4 or 8."""
    group_size: int | None
    """Inputs per group (None: a scale per output row)."""
    act_order: bool
    """Whether groups are scattered over the inputs (`g_idx`)."""

    def checkpoint_names(self, bias: bool) -> tuple[frozenset[str], frozenset[str]]:
        """The layer's checkpoint tensors: needed, and taken when present."""
        ...

    def unpack(self, name: str, loaded: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint tensor `name`, whole, as the shared form's tensors (see the module's docstring)."""
        ...


def kernel_group(input_size: int, group_size: int | None, bits: int) -> int | None:
    """The kernel's group for a checkpoint's `group_size` (None: one per row) over `input_size` inputs: the
    checkpoint's own, or for int4 128 where its groups are multiples of 128; None where none fits."""
    span = input_size if group_size is None else group_size
    if bits == 8:
        return span if span % 4 == 0 else None
    if span in quant_linear.INT4_GROUP_SIZES:
        return span
    largest = quant_linear.INT4_GROUP_SIZES[-1]
    return largest if span % largest == 0 else None


def scale_dtype(scales: torch.Tensor) -> torch.dtype:
    """float16 where it holds every scale exactly, else bfloat16 (the kernels keep one of the two)."""
    return torch.float16 if torch.equal(scales.to(torch.float16).float(), scales) else torch.bfloat16


def grouped_decoder_weight(bits: int, grouped: tuple[torch.Tensor, ...]) -> DecoderWeight:
    """A layer's codes in groups (`quant_linear.GROUPED[bits]`'s layout) for the C++ decoder stack."""
    return DecoderWeight(DecoderScheme.INT4 if bits == 4 else DecoderScheme.INT8_GROUPS, *grouped)


class GroupedIntMethod(QuantizedLinearMethod):
    """A checkpoint's 4- or 8-bit codes, scales and zero points on the int4 or grouped int8 kernel (see the
    module's docstring)."""

    input_parameters = frozenset({"g_idx"})

    def __init__(self, layout: CodeLayout) -> None:
        self.layout = layout
        self.scheme = "int4" if layout.bits == 4 else "int8"

    def refuses(self, input_size: int, output_size: int) -> str | None:
        group = self.layout.group_size
        if group is not None and input_size % group:
            return f"its inputs do not divide into the checkpoint's groups of {group}"
        if kernel_group(input_size, group, self.layout.bits) is None:
            if self.layout.bits == 8:
                return f"the grouped int8 kernel takes groups of a multiple of 4 inputs, not {group or input_size}"
            return f"the int4 kernel takes groups of {quant_linear.INT4_GROUP_SIZES} or multiples of 128, not {group}"
        return None

    def checkpoint_names(self, bias: bool) -> tuple[frozenset[str], frozenset[str]]:
        return self.layout.checkpoint_names(bias)

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, bias: bool, dtype: torch.dtype
    ) -> None:
        group = self.layout.group_size
        per_row = (output_size,) if group is None else (output_size, max(1, input_size // group))
        shapes = {"codes": ((output_size, input_size), torch.uint8), "scales": (per_row, torch.float32)}
        shapes["zeros"] = (per_row, torch.float32)
        if self.layout.act_order:
            shapes["g_idx"] = ((input_size,), torch.int32)
        for name, (shape, param_dtype) in shapes.items():
            setattr(layer, name, nn.Parameter(torch.empty(shape, dtype=param_dtype), requires_grad=False))
        layer.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False) if bias else None

    def checkpoint_tensors(self, name: str, loaded: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if name == "bias":
            yield name, loaded
        else:
            yield from self.layout.unpack(name, loaded)

    @torch.no_grad()
    def init_dummy(self, layer: nn.Module) -> bool:
        levels = 1 << self.layout.bits
        layer.codes.random_(0, levels)
        layer.scales.fill_(0.02 / (levels / 4))  # codes about a quarter of their range from the zero point: ~0.02
        layer.zeros.fill_(levels / 2)
        if self.layout.act_order:
            group = self.layout.group_size or layer.input_size
            layer.g_idx.copy_(torch.arange(layer.input_size) // group)
        return True

    @torch.no_grad()
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        codes, scales, zeros = layer.codes.detach(), layer.scales.detach(), layer.zeros.detach()
        if scales.dim() == 1:
            scales, zeros = scales[:, None], zeros[:, None]  # one group: the whole row
        layer.input_order = None
        if self.layout.act_order:
            order = torch.argsort(layer.g_idx.detach(), stable=True)  # inputs sorted by group
            groups = layer.g_idx.detach()[order]
            size = layer.input_size // scales.shape[1]
            if not torch.equal(groups, torch.arange(layer.input_size, dtype=groups.dtype) // size):
                raise ValueError(f"g_idx does not give each group {size} inputs")
            if not torch.equal(order, torch.arange(layer.input_size)):
                codes, layer.input_order = codes[:, order], order
        group = kernel_group(layer.input_size, self.layout.group_size, self.layout.bits)
        assert group is not None  # `refuses` turned the layer away otherwise
        repeat = layer.input_size // group // scales.shape[1]
        scales, zeros = scales.repeat_interleave(repeat, 1), zeros.repeat_interleave(repeat, 1)
        dtype = scale_dtype(scales)
        scales = scales.to(dtype).float()  # the minimum from the scale the kernel keeps
        layer.grouped = quant_linear.GROUPED[self.layout.bits].pack(codes.contiguous(), scales, -scales * zeros, dtype)
        drop_parameters(layer, ["codes", "scales", "zeros"] + (["g_idx"] if self.layout.act_order else []))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.input_order is not None:
            x = x.index_select(-1, layer.input_order)  # [..., in] in group order
        return quant_linear.GROUPED[self.layout.bits].linear(x, layer.grouped, layer.output_size, bias)

    def decoder_weight(self, layer: nn.Module) -> DecoderWeight | None:
        if layer.input_order is not None:
            return None  # x is gathered into group order first
        return grouped_decoder_weight(self.layout.bits, layer.grouped)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        weight = quant_linear.GROUPED[self.layout.bits].dequantize(layer.grouped, layer.output_size, layer.input_size)
        if layer.input_order is None:
            return weight
        unsorted = torch.empty_like(weight)
        unsorted[:, layer.input_order] = weight
        return unsorted


def unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32 / bits codes each along `dim`, the lowest bits first, -> uint8 codes (the dimension
    `32 / bits` times as long)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)  # [per_word]
    moved = words.movedim(dim, -1)  # [..., n]
    codes = (moved[..., None] >> shifts) & ((1 << bits) - 1)  # [..., n, per_word]
    return codes.reshape(*moved.shape[:-1], moved.shape[-1] * per_word).movedim(-1, dim).to(torch.uint8)
