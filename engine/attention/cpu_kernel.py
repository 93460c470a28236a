"""Builds and loads the CPU paged-attention kernel (`cpu_paged.cpp`) with torch's extension tooling.

Compiled at first use, not at install (`pip install` stays a plain Python install), and cached by torch under
`$TORCH_EXTENSIONS_DIR` (by default `~/.cache/torch_extensions`); torch's file lock in the build directory makes
processes that start at once wait for one build instead of racing.

The instruction set comes from torch's own CPU capability (what its kernels dispatch to on this machine, lowered
to AVX2 by `FERRY_CPU_ISA=avx2`: engine/cpu_isa.py), not `-march=native`, and the extension's name carries a hash
of the flags, the source, the compiler and torch's version: a cache built on an AVX-512 machine (or forced to AVX2
there) has another name than one built for AVX2, so it is never loaded where it would not run, and an edited source
or another torch never reuses a stale build.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from engine.cpu_isa import cpu_capability

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_paged.cpp")
_FLAGS = ["-O3", "-std=c++20", "-fopenmp", "-ffp-contract=fast"]
"""`-fopenmp` makes `at::parallel_for` parallel (it is OpenMP in the header) and enables `omp simd`; the OpenMP
runtime it links is the one torch ships (same soname, already loaded). FMA contraction is off by default in ISO
C++ mode."""
_ISA_FLAGS = {
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
}
"""By `cpu_capability()` (torch's own, or AVX2 where `FERRY_CPU_ISA=avx2` forces it); any other capability builds
for the architecture's baseline."""


class KernelUnavailable(RuntimeError):
    """The kernel could not be built or loaded here (no compiler, no ninja, a failed build)."""


def build_flags() -> list[str]:
    return [*_FLAGS, *_ISA_FLAGS.get(cpu_capability(), [])]


def extension_name(flags: list[str]) -> str:
    """A name unique to everything the binary depends on: source, flags, compiler, torch."""
    parts = [SOURCE.read_text(), *flags, os.environ.get("CXX", "c++"), torch.__version__]
    return "ferry_cpu_paged_" + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def load_kernel() -> Callable[..., torch.Tensor]:
    """`torch.ops.ferry_attention.paged_attention`, built on the first call of the process (seconds, once per
    machine, then a cache hit); raises `KernelUnavailable` when it cannot be built, on every call of the process
    without trying again."""
    outcome = _load()
    if isinstance(outcome, KernelUnavailable):
        raise outcome
    return outcome


@functools.cache
def _load() -> Callable[..., torch.Tensor] | KernelUnavailable:
    from torch.utils import cpp_extension

    flags = build_flags()
    name = extension_name(flags)
    logger.info("loading the CPU attention kernel %s (compiled once per machine and cached)", name)
    try:
        cpp_extension.load(
            name=name,
            sources=[str(SOURCE)],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as error:  # the tooling raises RuntimeError, OSError, CalledProcessError, ...
        return KernelUnavailable(f"{type(error).__name__}: {_gist(str(error))}")
    return torch.ops.ferry_attention.paged_attention


def _gist(message: str) -> str:
    """The compiler's errors, else the last lines: a build failure's message starts with whole command lines."""
    lines = [line.strip() for line in message.strip().splitlines()]
    errors = [line for line in lines if "error" in line.lower()]
    return " | ".join(errors[:3] or lines[-3:])
