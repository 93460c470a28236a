"""CPU paged attention that reads K/V pages in place: one C++ kernel call per layer for the whole step.

The kernel (`cpu_paged.cpp`, built by `engine/attention/cpu_kernel.py`) takes the step's metadata tensors as the
runner builds them (int32 `query_start_loc`, `seq_lens` and page tables, which it reads through their row
stride), so nothing is prepared per step or per layer in Python: decodes, prefill chunks over cached pages and
fresh prompts are the same loop in the kernel, which finds each sequence's visible keys (causal, sliding window)
from its length. Soft-capping and ALiBi biases are applied in the kernel, in the torch backend's order (scale,
soft-cap, bias), and so are sinks and non-causal spans (the metadata's `token_spans`). It computes in float32
whatever the cache's dtype: the query's own (float32, bfloat16, float16), or for a cache of another dtype float8
e4m3 (scaled), or bfloat16 under float32 queries.

The step's new K/V are written into their slots first, with `index_copy_` as in the torch backend, so a fresh
prompt reads its own keys from the pages like any other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from engine.attention.base import AttentionBackend, AttentionFeature, StepMetadata, write_kv

CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CpuPagedBackend(AttentionBackend):
    name = "cpu"
    features = frozenset(AttentionFeature)
    kv_cache_dtypes: ClassVar[dict[torch.dtype, frozenset[torch.dtype]]] = {
        torch.float32: frozenset({torch.bfloat16, torch.float8_e4m3fn}),
        torch.bfloat16: frozenset({torch.float8_e4m3fn}),
        torch.float16: frozenset({torch.float8_e4m3fn}),
    }
    capturable = True
    """The kernel reads only the metadata's tensors. Nothing is captured on CPU, but a padded decode step
    (engine/execution/cuda_graphs.py) runs through it exactly as a graph would run it."""

    def __init__(self, kernel: Callable[..., torch.Tensor]) -> None:
        """`kernel`: `engine.attention.cpu_kernel.load_kernel()`."""
        self._kernel = kernel

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: StepMetadata,
        scale: float,
        sliding_window: int | None,
        *,
        softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        write_kv(key, value, kv_cache, meta.slot_mapping, k_scale, v_scale)
        return self._kernel(
            query,
            kv_cache[0],
            kv_cache[1],
            meta.query_start_loc,
            meta.seq_lens,
            meta.page_tables,
            scale,
            sliding_window or 0,
            softcap or 0.0,
            alibi_slopes,
            sinks,
            meta.token_spans,
            k_scale,
            v_scale,
        )
