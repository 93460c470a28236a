"""The CPU instruction set Ferry builds and chooses its CPU paths for, read once from the environment.

`FERRY_CPU_ISA=avx2` makes an AVX512 machine take the AVX2 paths: bfloat16 linears widened to float32 (the blocked
kernel, or `WidenedLinearMethod` without it) instead of oneDNN-packed bfloat16, and the C++ kernels built with the
AVX2 flags.
So one machine's test run covers both kinds of CPU the project runs on. Unset (or empty), the machine's own
capability decides. The switch only ever lowers what is used: an AVX2 machine is unchanged by it.
"""

from __future__ import annotations

import functools
import os

import torch

ISA_VARIABLE = "FERRY_CPU_ISA"
_FORCEABLE = ("avx2",)


@functools.cache
def forced_isa() -> str | None:
    """The instruction set `FERRY_CPU_ISA` forces (lower-cased), or None; anything unknown is refused by name."""
    value = os.environ.get(ISA_VARIABLE, "").strip().lower()
    if not value:
        return None
    if value not in _FORCEABLE:
        raise ValueError(f"{ISA_VARIABLE}={value!r}: the instruction sets it can force are {', '.join(_FORCEABLE)}")
    return value


def cpu_capability() -> str:
    """torch's CPU capability name (`AVX2`, `AVX512`, ...), lowered to `AVX2` when forced and above it."""
    capability = torch.backends.cpu.get_cpu_capability()
    if forced_isa() == "avx2" and capability.startswith("AVX512"):
        return "AVX2"
    return capability


def bf16_arithmetic() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16, AMX, AVX-NE-CONVERT), as Ferry may use it."""
    return forced_isa() is None and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags /proc/cpuinfo lists for this CPU (empty where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def bf16_dot_products() -> bool:
    """Whether the CPU kernels take AVX512-BF16's bfloat16 dot products (`vdpbf16ps`): an AVX-512 build on a CPU
    that has them. The blocked linear then keeps bfloat16 weights in pairs along k (engine/kernels/linear.py)."""
    return cpu_capability() == "AVX512" and "avx512_bf16" in cpu_flags()


def amx_tiles() -> bool:
    """Whether the CPU has AMX's bfloat16 tiles, which oneDNN multiplies many rows with (Intel Xeon 4th generation
    on)."""
    return "amx_bf16" in cpu_flags()
