"""compressed-tensors checkpoints (llm-compressor's output): their weights kept as they are stored.

`quantization_config.config_groups` says, for the linears a group targets, how weights (and activations) were
quantized; `format` how they are stored. What Ferry serves, and on what:

- `int-quantized` int8 weights with a scale per output row, symmetric (W8A8, W8A16 by channel): the codes and
  scales as stored on the int8 kernels; activations quantized per token at each step (W8A8) take the W8A8 kernel,
  the integer dot products llm-compressor's scheme means (each token's scale max |x| / 127, as vLLM takes it;
  compressed-tensors' own reference divides by 127.5 and lets -128 in), none (W8A16) the weight-only one.
- `pack-quantized` 4-bit (W4A16, W4A16_ASYM): eight codes a 32-bit word along the input, each stored as q + 8 (q
  signed), zero points (asymmetric) packed the same way along the output: the int4 kernel's groups
  (engine/quantization/grouped.py) with codes q + 8 and zero points zp + 8. 8-bit `pack-quantized` (W8A16: four
  codes a word, q + 128) by group, or asymmetric, on the grouped int8 kernel the same way; symmetric by channel on
  the int8 kernels as its codes minus 128.
- `float-quantized` e4m3 weights (FP8_DYNAMIC: a scale per output row, activations per token at each step; FP8: one
  scale per tensor and a static scale per tensor for the activations) on the fp8 method. A fused layer's parts
  (q, k, v) have a scale each: the weights keep theirs row by row, and the activations take the largest of the
  parts' static scales (vLLM's choice: x is the same for all three, and no part's activations then clip).

Refused by name: int8 weights in groups or asymmetric under quantized activations, static int8 activations,
other bit widths, a quantized LM head, sparsity, transforms, a quantized KV cache, and linears under
different schemes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.quantization.base import CheckpointQuantization, CheckpointQuantizedMethod
from engine.quantization.fp8 import FP8_DTYPE, FP8_MAX, Fp8LinearMethod
from engine.quantization.grouped import GroupedIntMethod, unpack_words
from engine.quantization.int8 import Int8LinearMethod, W8A8LinearMethod

FORMAT = "compressed-tensors"


class CheckpointScalesMixin(CheckpointQuantizedMethod):
    """Codes and a scale per output row (or one per tensor) read from the checkpoint, not quantized again."""

    unpack_codes: Callable[[torch.Tensor], torch.Tensor]
    code_name = "weight"
    extra_names: frozenset[str] = frozenset()

    def checkpoint_names(self, bias: bool) -> tuple[frozenset[str], frozenset[str]]:
        needed = {self.code_name, "weight_scale"} | self.extra_names | ({"bias"} if bias else set())
        # A symmetric scheme's zero points (all zero), which some compressed-tensors versions store anyway.
        return frozenset(needed), frozenset({"weight_shape", "weight_zero_point"})

    def checkpoint_tensors(self, name: str, loaded: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if name == self.code_name:
            yield "weight", self.unpack_codes(loaded)
        elif name in ("weight_scale", "input_scale"):
            yield name, loaded.reshape(-1).float()  # [out, 1] (or [1]) -> [out] (or [1], spread over the part)
        elif name == "bias":
            yield name, loaded


def _int8_codes(packed: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    if not packed:
        return lambda codes: codes
    return lambda words: (unpack_words(words, 8, 1).to(torch.int16) - 128).to(torch.int8)


class CheckpointInt8Method(CheckpointScalesMixin, Int8LinearMethod):
    def __init__(self, packed: bool) -> None:
        self.unpack_codes = _int8_codes(packed)
        self.code_name = "weight_packed" if packed else "weight"


class CheckpointW8A8Method(CheckpointScalesMixin, W8A8LinearMethod):
    def __init__(self, packed: bool) -> None:
        self.unpack_codes = _int8_codes(packed)
        self.code_name = "weight_packed" if packed else "weight"


class CheckpointFp8Method(CheckpointScalesMixin, Fp8LinearMethod):
    """e4m3 codes and their scales as stored; with `static`, the activations' scale too (see the module's
    docstring)."""

    unpack_codes = staticmethod(lambda codes: codes)

    def __init__(self, static: bool) -> None:
        self.static = static
        self.extra_names = frozenset({"input_scale"}) if static else frozenset()

    def parameter_specs(self, input_size: int, output_size: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        specs = super().parameter_specs(input_size, output_size)
        if self.static:
            specs["input_scale"] = ((output_size,), torch.float32)  # each part's, row by row
        return specs

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        quantized = super().quantize(weight)
        if self.static:  # dummy weights: activations of about unit size
            quantized["input_scale"] = torch.full((len(weight),), 4.0 / FP8_MAX)
        return quantized

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.static:
            layer.fp8_input_scale = layer.input_scale.detach().amax()
            del layer.input_scale
        super().process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.static:
            return super().apply(layer, x, bias)
        rows = x.reshape(-1, x.shape[-1])  # [N, in]
        scale = layer.fp8_input_scale
        codes = (rows.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # [N, in]
        out = torch._scaled_mm(
            codes, layer.fp8_weight.t(), scale_a=scale.reshape(1, 1).repeat(len(rows), 1), scale_b=layer.fp8_scale,
            bias=bias, out_dtype=x.dtype,
        )  # fmt: skip
        return out.view(*x.shape[:-1], out.shape[-1])


@dataclass(frozen=True)
class PackedLayout:
    """`pack-quantized` codes, scales and zero points (see the module's docstring)."""

    bits: int
    group_size: int | None
    symmetric: bool
    act_order: bool = False
    format: str = FORMAT

    def checkpoint_names(self, bias: bool) -> tuple[frozenset[str], frozenset[str]]:
        needed = {"weight_packed", "weight_scale"} | (set() if self.symmetric else {"weight_zero_point"})
        optional = {"weight_shape"} | ({"weight_zero_point"} if self.symmetric else set())  # zeros some store anyway
        return frozenset(needed | ({"bias"} if bias else set())), frozenset(optional)

    def unpack(self, name: str, loaded: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if name == "weight_packed":
            yield "codes", unpack_words(loaded, self.bits, 1)  # [out, in]: q + 2^(bits - 1)
        elif name == "weight_scale":
            scales = loaded.float()  # [out, groups]
            yield "scales", scales[:, 0] if self.group_size is None else scales
            if self.symmetric:
                offset = float(1 << (self.bits - 1))
                yield "zeros", torch.full_like(scales[:, 0] if self.group_size is None else scales, offset)
        elif name == "weight_zero_point" and not self.symmetric:
            zeros = unpack_words(loaded, self.bits, 0).float()  # [out, groups]: zp + 2^(bits - 1)
            yield "zeros", zeros[:, 0] if self.group_size is None else zeros


def scheme(config: dict[str, Any], refuse: Callable[[str], Exception]) -> CheckpointQuantization:
    """`quantization_config` of a compressed-tensors checkpoint -> how Ferry runs it; `refuse(why)` is raised for
    what it cannot run (see the module's docstring)."""
    for key, what in (("sparsity_config", "sparsity"), ("transform_config", "transforms"),
                      ("kv_cache_scheme", "a quantized KV cache")):  # fmt: skip
        if config.get(key):
            raise refuse(f"{what} ({key})")
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise refuse(f"{len(groups)} config groups (Ferry runs one scheme for every decoder linear)")
    group = groups[0]
    if group.get("targets") != ["Linear"]:
        raise refuse(f"a config group targeting {group.get('targets')} (not every linear)")
    if "lm_head" not in (config.get("ignore") or []):
        raise refuse("a quantized lm_head (not in `ignore`)")
    extra = [name for name in config.get("ignore") or [] if name != "lm_head"]
    if extra:
        raise refuse(f"linears left unquantized inside the decoder ({', '.join(extra[:3])})")
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    if group.get("output_activations"):
        raise refuse("quantized output activations")
    storage = group.get("format") or config.get("format")
    bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
    symmetric, group_size = weights.get("symmetric", True), weights.get("group_size")
    if weights.get("actorder") not in (None, "static"):
        raise refuse(f"activation order {weights['actorder']!r}")
    if kind == "float" and bits == 8 and storage == "float-quantized":
        return _fp8(strategy, inputs, refuse)
    if kind != "int" or (bits, storage) not in ((8, "int-quantized"), (8, "pack-quantized"), (4, "pack-quantized")):
        raise refuse(f"{bits}-bit {kind} weights stored {storage!r}")
    if strategy not in ("group", "channel"):
        raise refuse(f"{bits}-bit weights by {strategy!r}")
    if bits == 4:
        if inputs:
            raise refuse("4-bit weights with quantized activations")
        return _grouped(4, strategy, group_size, symmetric)
    packed = storage == "pack-quantized"
    if not inputs and packed and (strategy == "group" or not symmetric):
        return _grouped(8, strategy, group_size, symmetric)  # the grouped int8 kernel (a zero point per group)
    if strategy != "channel" or not symmetric:
        side = "" if symmetric else ", asymmetric"
        where = "with quantized activations" if inputs else "stored unpacked (int-quantized)"
        raise refuse(f"int8 weights by {strategy!r}{side} {where} (the int8 kernels take a symmetric scale per "
                     "output row; grouped int8 is read from pack-quantized weights)")  # fmt: skip
    if not inputs:
        return CheckpointQuantization(
            FORMAT, "int8 weights, a scale per output row", "int8", lambda: CheckpointInt8Method(packed)
        )
    if (inputs.get("type"), inputs.get("num_bits"), inputs.get("strategy"), inputs.get("dynamic")) != (
        "int",
        8,
        "token",
        True,
    ) or not inputs.get("symmetric", True):
        raise refuse("int8 activations other than dynamic, symmetric, per token")
    return CheckpointQuantization(
        FORMAT,
        "int8 weights by output row, int8 activations by token",
        "int8-dynamic",
        lambda: CheckpointW8A8Method(packed),
    )


def _grouped(bits: int, strategy: str, group_size: int | None, symmetric: bool) -> CheckpointQuantization:
    layout = PackedLayout(bits, group_size if strategy == "group" else None, symmetric)
    side = "symmetric" if symmetric else "asymmetric"
    where = f"groups of {group_size}" if strategy == "group" else "a scale per output row"
    return CheckpointQuantization(
        FORMAT, f"int{bits} weights, {side}, {where}", f"int{bits}", lambda: GroupedIntMethod(layout)
    )


def _fp8(strategy: str, inputs: dict[str, Any] | None, refuse: Callable[[str], Exception]) -> CheckpointQuantization:
    if strategy not in ("channel", "tensor"):
        raise refuse(f"fp8 weights by {strategy!r}")
    where = "a scale per output row" if strategy == "channel" else "a scale per tensor"
    if inputs is None:
        raise refuse("fp8 weights with activations left unquantized (no weight-only fp8 kernel)")
    dynamic = (inputs.get("type"), inputs.get("num_bits"), inputs.get("strategy"), inputs.get("dynamic"))
    if dynamic == ("float", 8, "token", True):
        return CheckpointQuantization(
            FORMAT, f"fp8 weights, {where}, fp8 activations by token", "fp8", lambda: CheckpointFp8Method(static=False)
        )
    if dynamic == ("float", 8, "tensor", False):
        return CheckpointQuantization(FORMAT,
            f"fp8 weights, {where}, fp8 activations with a static scale", "fp8",
            lambda: CheckpointFp8Method(static=True),
        )  # fmt: skip
    raise refuse(f"fp8 activations by {inputs.get('strategy')!r}, dynamic={inputs.get('dynamic')}")
