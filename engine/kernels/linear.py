"""The blocked linear kernel's weight layout (`cpu_linear.cpp`, built into engine/kernels/library.py's extension).

`pack` turns a `[out, in]` weight into `[ceil(out / 16), in, 16]`, the layout `torch.ops.ferry_kernels.linear`
streams (see the source's header); `embed_rows` reads rows of the original matrix back out of it, so a tied
embedding and LM head keep one copy in this layout.
"""

from __future__ import annotations

import torch

BLOCK = 16
"""Output rows per block of the packed layout: one AVX-512 vector of float32 (two of AVX2)."""


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
