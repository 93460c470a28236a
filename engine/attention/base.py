"""The step description every backend receives, and the interface they share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class StepMetadata:
    """Layer-independent description of one packed step, built once by the runner.

    Token i of the packed row belongs to sequence `seq_of_token[i]`, sits at position `positions[i]`, and its
    K/V go to cache slot `slot_mapping[i]` (page * page_size + offset).
    """

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths (cu_seqlens_q)
    seq_lens: torch.Tensor  # [B] int32, KV length of each sequence after this step
    page_tables: torch.Tensor  # [B, max_pages] int32; pages outside a sequence's visible range are never read
    page_tables_host: np.ndarray  # [B, max_pages] int32, the same on the host (unused columns hold 0)
    query_start_loc_host: list[int]
    query_lens_host: list[int]
    seq_lens_host: list[int]
    max_query_len: int
    max_seq_len: int
    page_size: int
    backend_state: dict[Any, Any] = field(default_factory=dict)
    """Per-step caches a backend derives lazily (gather indices, masks per window size)."""

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)


class AttentionBackend(ABC):
    name: str
    capturable: bool = False
    """Whether a CUDA graph can hold this backend's decode steps (engine/execution/cuda_graphs.py): its `prepare` and
    `forward` read only the metadata's tensors, plus `max_query_len` and `page_size`, never the host lists (a
    graph replays with new tensor contents but the host fields of the step it captured), and they neither
    synchronise with the host nor allocate outside torch's allocator."""

    def prepare(self, meta: StepMetadata) -> None:  # noqa: B027 - optional hook
        """Derive per-step, layer-independent state before the first layer runs."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # each [num_pages, page_size, Hkv, D]
        meta: StepMetadata,
        scale: float,
        sliding_window: int | None,
        *,
        softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, H, D]
        """Causal attention of each sequence's queries over its pages. `softcap`: scores (after `scale`) become
        `softcap * tanh(scores / softcap)` before masking and softmax. `alibi_slopes` ([H], float32): each head
        adds `slope * (key_position - query_position)` to its scores after soft-capping, where the mask goes."""


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor):
    k_cache, v_cache = kv_cache
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value)
