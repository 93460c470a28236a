"""Ferry's CPU kernel library: one extension, `torch.ops.ferry_kernels`, built from every source here by
engine/kernels/build.py (one build, one set of instruction-set flags): the blocked linear (`cpu_linear.cpp`), the
quantized linears (`cpu_quant_linear.cpp`, engine/kernels/quant_linear.py), RMSNorm (`cpu_norm.cpp`), rotary
embedding and SiLU-and-multiply, and the vision encoders' QuickGELU and float32 rotary (`cpu_pointwise.cpp`), LoRA's
products (`cpu_lora.cpp`), a mixture of experts' routed rows (`cpu_experts.cpp`), the state-space scans' decode step
(`cpu_ssm.cpp`), greedy sampling's argmax (`cpu_argmax.cpp`). Their shapes are registered for `torch.compile`."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from engine.kernels.build import KernelUnavailable, load_library

CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes the kernels take (others run torch's ops)."""
SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "cpu_linear.cpp",
        "cpu_quant_linear.cpp",
        "cpu_norm.cpp",
        "cpu_pointwise.cpp",
        "cpu_decoder.cpp",
        "cpu_lora.cpp",
        "cpu_experts.cpp",
        "cpu_ssm.cpp",
        "cpu_argmax.cpp",
    )
]
HEADERS = [
    Path(__file__).with_name(name) for name in ("kernels.h", "blocked.h", "helping.h", "bfloat16.h", "fast_math.h")
]
"""The kernels' entry points, for the decoder (`cpu_decoder.cpp`), which calls the others; the blocked layouts' tiles,
shared by the linear kernels."""


def load_cpu_kernels() -> None:
    """Make `torch.ops.ferry_kernels` available (built on the first call of the process, once per machine); raises
    `KernelUnavailable` on every call of a process where it cannot be had."""
    outcome = _load()
    if outcome is not None:
        raise outcome


def cpu_kernels_available() -> bool:
    """Whether the kernels could be had; a compiled graph takes the answer as traced (engine/execution/compile.py)."""
    try:
        load_cpu_kernels()
    except KernelUnavailable:
        return False
    return True


def cpu_kernels_take(x: torch.Tensor) -> bool:
    """Whether the kernels compute ops on `x`: a float32 or bfloat16 tensor on the CPU, where they could be built."""
    return x.device.type == "cpu" and x.dtype in CPU_KERNEL_DTYPES and cpu_kernels_available()


_helper_on = False


def set_linear_helper(on: bool) -> None:
    """Whether the blocked linears of a step on one thread take a helper thread (helping.h): on while a step of
    `HELPER_MIN_TOKENS` or more follows the load and leaves a core of the rank out (a busy front end beside it:
    engine/execution/cpu_threads.py). Calls the kernels only on a change; nothing where they cannot be had."""
    global _helper_on
    if on != _helper_on and cpu_kernels_available():
        torch.ops.ferry_kernels.set_linear_helper(on)
        _helper_on = on


def linear_helper_on() -> bool:
    """Whether the helper thread is on (`set_linear_helper`)."""
    return _helper_on


@functools.cache
def _load() -> KernelUnavailable | None:
    try:
        load_library("ferry_cpu_kernels", SOURCES, "CPU kernels", headers=HEADERS)
    except KernelUnavailable as error:
        return error
    torch.library.register_fake("ferry_kernels::linear")(_linear_shape)
    torch.library.register_fake("ferry_kernels::embed_rows")(_embed_rows_shape)
    torch.library.register_fake("ferry_kernels::argmax_rows")(_argmax_rows_shape)
    torch.library.register_fake("ferry_kernels::int8_linear")(_int8_linear_shape)
    torch.library.register_fake("ferry_kernels::int4_linear")(_grouped_linear_shape)
    torch.library.register_fake("ferry_kernels::int8_group_linear")(_grouped_linear_shape)
    torch.library.register_fake("ferry_kernels::w8a8_linear")(_int8_linear_shape)
    torch.library.register_fake("ferry_kernels::rms_norm")(_norm_shape)
    torch.library.register_fake("ferry_kernels::rotary")(_rotary_shape)
    torch.library.register_fake("ferry_kernels::silu_mul")(_silu_mul_shape)
    torch.library.register_fake("ferry_kernels::experts")(_experts_shape)
    return None


def _linear_shape(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def _embed_rows_shape(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    in_features = packed.shape[1] * (packed.shape[3] if packed.dim() == 4 else 1)
    return packed.new_empty(*ids.shape, in_features)


def _argmax_rows_shape(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], dtype=torch.long)


def _int8_linear_shape(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    code_sums: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def _grouped_linear_shape(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def _norm_shape(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _rotary_shape(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)


def _experts_shape(pairs: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return pairs.new_empty(pairs.shape)


def _silu_mul_shape(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))
