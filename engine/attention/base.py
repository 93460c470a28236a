"""The step description every backend receives, the interface they share, and what each one can do.

A query at position q sees key k when `k <= q` (and, in a sliding-window layer, `q - k < window`), or when both
lie in one of the sequence's non-causal spans: a span's tokens (an image's, an encoder's whole input) attend to
each other in both directions. In a sliding-window layer of a causal model they do so inside the window or not
(Gemma 3's images); in an encoder's (a bidirectional model: ModernBERT's local layers) a span's query sees the
span's keys within the window either way, `|q - k| < window`. Since a span holds its query, the keys one query sees
are always one interval, `[lo, hi)`, which the runner computes per KV-cache group (`span_intervals`) and the
kernels read as they are (`StepMetadata.token_spans`). A span's keys past a query must be in the cache when it
attends, so a step whose queries enter a span computes it to its end (the runner refuses a plan that cuts one).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from engine.config import EngineStartupError
from engine.core.request import Spans


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
    noncausal_spans_host: list[Spans] | None = None
    """Per sequence, the non-causal spans its queries this step lie in; None when no query of the step is in one
    (every step of a text-only model: the backends' plain causal path)."""
    token_spans: torch.Tensor | None = None
    """[T, 2] int32 on the device, set with `noncausal_spans_host`: for each query in a span, the keys `[lo, hi)` it
    sees (`span_intervals`: the span and the layer's window together); `(0, 0)` for a query in none, which sees
    what causal attention and the window give it. What the kernels read."""
    token_spans_host: np.ndarray | None = None
    """The same on the host (the torch backend's masks)."""
    backend_state: dict[Any, Any] = field(default_factory=dict)
    """Per-step caches a backend derives lazily (gather indices, masks per window size)."""

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)


class SplitSpan(ValueError):
    """A step's queries enter a non-causal span that the step does not compute to its end."""


def step_spans(spans: list[Spans], computed: np.ndarray, seq_lens: np.ndarray) -> tuple[list[Spans], np.ndarray] | None:
    """The spans of a step whose sequences compute positions `[computed, seq_lens)`, given each sequence's spans:
    per sequence the spans its queries lie in, and `[T, 2]` int32 `(start, end)` of the span holding each query,
    `(0, 0)` outside them (what `span_intervals` turns into each layer's intervals); None when no query lies in
    one. Raises `SplitSpan` for a span the step enters and cuts."""
    entered: list[Spans] = []
    for own, first, end in zip(spans, computed.tolist(), seq_lens.tolist(), strict=True):
        hit = tuple((s, e) for s, e in own if s < end and e > first)
        for s, e in hit:
            if e > end:
                raise SplitSpan(f"the step computes positions up to {end}, inside the non-causal span [{s}, {e})")
        entered.append(hit)
    if not any(entered):
        return None
    bounds = np.zeros((int((seq_lens - computed).sum()), 2), dtype=np.int32)
    row = 0
    for hit, first, end in zip(entered, computed.tolist(), seq_lens.tolist(), strict=True):
        for s, e in hit:
            bounds[row + max(s, first) - first : row + e - first] = (s, e)
        row += end - first
    return entered, bounds


def span_intervals(bounds: np.ndarray, positions: np.ndarray, window: int | None, bidirectional: bool) -> np.ndarray:
    """`[T, 2]` int32: the keys `[lo, hi)` each query in a span sees (`(0, 0)` stays for a query in none), given the
    spans holding them (`step_spans`' bounds), their positions, and the layer's window. A causal model's span
    query sees what its window gives it and the whole span; a bidirectional model's (an encoder's) sees the span's
    keys within the window on either side."""
    start, end = bounds[:, 0].astype(np.int64), bounds[:, 1].astype(np.int64)
    inside = start < end
    if window is None:
        lo = np.where(bidirectional, start, 0)
        hi = end
    elif bidirectional:
        lo = np.maximum(start, positions - window + 1)
        hi = np.minimum(end, positions + window)
    else:
        lo = np.minimum(np.maximum(positions - window + 1, 0), start)
        hi = end
    return np.where(inside[:, None], np.stack([lo, hi], axis=1), 0).astype(np.int32)


class AttentionFeature(enum.Enum):
    """What a layer may ask of attention beyond causal attention over its pages, in the backend's `forward`."""

    SLIDING_WINDOW = "sliding windows"
    SOFTCAP = "soft-capped scores"
    ALIBI = "ALiBi biases"
    SINKS = "attention sinks"
    NONCAUSAL_SPANS = "non-causal spans"
    LATENT = "latent (MLA) attention: one KV head as wide as the latent and its rotary part (576 for DeepSeek)"


@dataclass(frozen=True)
class AttentionNeeds:
    """What a model needs of its attention backend: the features its layers use and the KV cache's dtype."""

    features: frozenset[AttentionFeature] = frozenset()
    kv_cache_dtype: torch.dtype | None = None
    """None: the model's own dtype."""


NO_NEEDS = AttentionNeeds()
"""Causal attention over a cache in the model's dtype: what every backend computes."""


class UnsupportedAttention(EngineStartupError):
    """The backend asked for cannot compute what the model needs; the message names the backend and each need."""


class AttentionBackend(ABC):
    name: str
    features: ClassVar[frozenset[AttentionFeature]] = frozenset()
    """What `forward` computes exactly; a layer asking for anything else is refused at backend selection."""
    kv_cache_dtypes: ClassVar[dict[torch.dtype, frozenset[torch.dtype]]] = {}
    """By model dtype, the cache dtypes other than its own that `forward` writes and reads (scaled)."""
    capturable: bool = False
    """Whether a CUDA graph can hold this backend's decode steps (engine/execution/cuda_graphs.py): its `prepare` and
    `forward` read only the metadata's tensors, plus `max_query_len` and `page_size`, never the host lists (a
    graph replays with new tensor contents but the host fields of the step it captured), and they neither
    synchronise with the host nor allocate outside torch's allocator."""

    @classmethod
    def missing(cls, needs: AttentionNeeds, dtype: torch.dtype) -> list[str]:
        """What of `needs` this backend cannot compute for a model in `dtype` (empty: it serves the model)."""
        lacking = [feature.value for feature in AttentionFeature if feature in needs.features - cls.features]
        cache_dtype = needs.kv_cache_dtype
        if cache_dtype not in (None, dtype) and cache_dtype not in cls.kv_cache_dtypes.get(dtype, frozenset()):
            lacking.append(f"a {cache_dtype} KV cache for a {dtype} model")
        return lacking

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
        sinks: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [T, H, D]
        """Attention of each sequence's queries over its pages, causal outside the metadata's non-causal spans.
        `softcap`: scores (after `scale`) become `softcap * tanh(scores / softcap)` before masking and softmax.
        `alibi_slopes` ([H], float32): each head adds `slope * (key_position - query_position)` to its scores after
        soft-capping, where the mask goes. `sinks` ([H], float32): one more logit per head in the softmax's
        denominator, attending to nothing (gpt-oss). `k_scale`, `v_scale`: a cache whose dtype is not the query's
        holds `key / k_scale` and `value / v_scale` (see `write_kv`), and is read back times the scale."""


def to_cache(x: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    if x.dtype == cache.dtype and scale == 1.0:
        return x
    x = x.float() / scale if scale != 1.0 else x.float()
    if is_float8(cache.dtype):
        # Casting to float8 does not saturate: what lies beyond the format's range would become NaN.
        bound = torch.finfo(cache.dtype).max
        x = x.clamp(-bound, bound)
    return x.to(cache.dtype)


def dense_attention(
    query: torch.Tensor,  # [L, H, D]: one sequence's rows of the packed step
    key: torch.Tensor,  # [L, Hkv, D]
    value: torch.Tensor,  # [L, Hkv, Dv]
    scale: float,
    *,
    causal: bool,
) -> torch.Tensor:  # [L, H, Dv]
    """One sequence's queries over keys and values all computed with them (a fresh prompt, an image's patches),
    causal or every way, with torch's SDPA in the packed rows' layout; grouped-query keys are taken as they are."""
    attended = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),
        key.transpose(0, 1).unsqueeze(0),
        value.transpose(0, 1).unsqueeze(0),
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )  # [1, H, L, Dv]
    return attended[0].transpose(0, 1)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """The step's K/V into their slots, in the cache's dtype: divided by the scale (and for float8 saturated to its
    range) when the cache's dtype or the scale is not the identity. A cache whose K and V are one tensor (a latent
    layer's, whose values are its keys: engine/models/deepseek.py) is written once."""
    parts = [(kv_cache[0], key, k_scale)]
    if not (kv_cache[1] is kv_cache[0] and value is key and v_scale == k_scale):
        parts.append((kv_cache[1], value, v_scale))
    for cache, x, scale in parts:
        as_stored = to_cache(x, cache, scale)
        if is_float8(cache.dtype):  # torch copies float8 by index only as the bytes they are
            cache, as_stored = cache.view(torch.uint8), as_stored.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, as_stored)


def is_float8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def from_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cache contents back in the model's `dtype`: widened and times `scale` (nothing when neither applies)."""
    if x.dtype == dtype and scale == 1.0:
        return x
    x = x.float() * scale if scale != 1.0 else x.float()
    return x.to(dtype)
