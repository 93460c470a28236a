"""The blocked linear kernel's weight layouts (`cpu_linear.cpp`, built into engine/kernels/library.py's extension).

`pack` turns a `[out, in]` weight into `[ceil(out / 16), in, 16]`, the layout `torch.ops.ferry_kernels.linear`
streams (see the source's header); a bfloat16 weight of even width on a CPU with AVX512-BF16 goes into pairs along
k instead, `[ceil(out / 16), in / 2, 16, 2]`, which the kernel multiplies with bfloat16 dot products. `embed_rows` reads
rows of the original matrix back out of either, so a tied embedding and LM head keep one copy in it.
"""

from __future__ import annotations

import torch

from engine.cpu_isa import bf16_dot_products

BLOCK = 16
"""Output rows per block of the packed layout: one AVX-512 vector of float32 (two of AVX2)."""


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`[out, in]` -> `[ceil(out / 16), in, 16]`: block b's k-th 16 values are W[16b : 16b + 16, k], zeros past
    `out`; for bfloat16 of even `in` where the kernels take its dot products, `[ceil(out / 16), in / 2, 16, 2]`:
    block b's p-th 32 values are W[16b + j, 2p + t] at (j, t), zeros past `out`. Written in one copy: beside the
    weight, only its packed form exists, one layer at a time."""
    out_features, in_features = weight.shape
    full, rest = divmod(out_features, BLOCK)
    # Both layouts are [blocks, in / group, 16, group]: k in groups of `group` consecutive weights of a row.
    group = 2 if weight.dtype == torch.bfloat16 and in_features % 2 == 0 and bf16_dot_products() else 1
    columns = in_features // group
    packed = torch.empty(full + (rest > 0), columns, BLOCK, group, dtype=weight.dtype, device=weight.device)
    packed[:full] = weight[: full * BLOCK].view(full, BLOCK, columns, group).transpose(1, 2)
    if rest:
        packed[full] = 0
        packed[full, :, :rest] = weight[full * BLOCK :].view(rest, columns, group).transpose(0, 1)
    return packed if group == 2 else packed.squeeze(-1)


def embed_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the matrix `packed` was made from: `[*ids.shape, in]` (the kernel library's op: a decode step's
    lookup through torch's indexing cost ~30 us)."""
    return torch.ops.ferry_kernels.embed_rows(packed, ids)
