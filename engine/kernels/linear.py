"""The blocked linear kernel (`cpu_linear.cpp`): its weight layout, and the op built from it.

`pack` turns a `[out, in]` weight into `[ceil(out / 16), in, 16]`, the layout `torch.ops.ferry_linear.linear`
streams (see the source's header); `embed_rows` reads rows of the original matrix back out of it, so a tied
embedding and LM head keep one copy in this layout. The op's shapes are registered for `torch.compile`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from engine.kernels.build import KernelUnavailable, load_library

SOURCE = Path(__file__).with_name("cpu_linear.cpp")
BLOCK = 16
"""Output rows per block of the packed layout: one AVX-512 vector of float32 (two of AVX2)."""


def load_linear_kernel() -> None:
    """Make `torch.ops.ferry_linear.linear` available (built on the first call of the process, once per machine);
    raises `KernelUnavailable` on every call of a process where it cannot be had."""
    outcome = _load()
    if outcome is not None:
        raise outcome


@functools.cache
def _load() -> KernelUnavailable | None:
    try:
        load_library("ferry_cpu_linear", [SOURCE], "CPU linear kernel")
    except KernelUnavailable as error:
        return error
    torch.library.register_fake("ferry_linear::linear")(_linear_shape)
    return None


def _linear_shape(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`[out, in]` -> `[ceil(out / 16), in, 16]`: block b's k-th 16 values are W[16b : 16b + 16, k], zeros past
    `out`. Written in one copy: beside the weight, only its packed form exists, one layer at a time."""
    out_features, in_features = weight.shape
    full, rest = divmod(out_features, BLOCK)
    packed = torch.empty(full + (rest > 0), in_features, BLOCK, dtype=weight.dtype, device=weight.device)
    packed[:full] = weight[: full * BLOCK].view(full, BLOCK, in_features).transpose(1, 2)
    if rest:
        packed[full] = 0
        packed[full, :, :rest] = weight[full * BLOCK :].t()
    return packed


def embed_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the matrix `packed` was made from: `[*ids.shape, in]`."""
    flat = ids.reshape(-1)
    return packed[flat // BLOCK, :, flat % BLOCK].view(*ids.shape, packed.shape[1])
