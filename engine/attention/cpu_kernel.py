"""Loads the CPU paged-attention kernel (`cpu_paged.cpp`), built once per machine by engine/kernels/build.py (named
by its source's content and the CPU's instruction set, interruptible, processes taking turns)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from engine.kernels.build import KernelUnavailable, load_library

SOURCE = Path(__file__).with_name("cpu_paged.cpp")

__all__ = ["SOURCE", "KernelUnavailable", "load_kernel"]


def load_kernel() -> Callable[..., torch.Tensor]:
    """`torch.ops.ferry_attention.paged_attention`, built on the first call of the process (once per machine, then
    a cache hit); raises `KernelUnavailable` when it cannot be had, on every call of the process without trying
    again."""
    outcome = _load()
    if isinstance(outcome, KernelUnavailable):
        raise outcome
    return outcome


@functools.cache
def _load() -> Callable[..., torch.Tensor] | KernelUnavailable:
    try:
        load_library("ferry_cpu_paged", [SOURCE], "CPU attention kernel")
    except KernelUnavailable as error:
        return error
    return torch.ops.ferry_attention.paged_attention
