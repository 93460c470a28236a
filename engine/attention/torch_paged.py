"""Plain-torch paged attention: the CPU backend, and the reference the GPU backends are checked against.

Decode tokens (one query each, the bulk of a busy step) are attended in groups of similar length: each group's
pages are gathered in one `index_select` into a `[group, pages * page_size]` block padded to the group's longest
sequence, and one masked `scaled_dot_product_attention` serves the whole group. Grouping by length keeps the
padding small; one call per group instead of one per sequence is what makes decode cheap (a per-sequence call
costs ~50 us of dispatch, more than its arithmetic).

Prefill chunks attend one by one with no padding: a chunk with no cached history (a fresh prompt) attends only to
its own K/V, a chunk continuing a sequence over its gathered pages with a causal mask.

Whole pages are gathered (memcpy-sized rows; advanced indexing is several times slower here).

ALiBi biases depend on heads and positions but not on the layer, so they are folded into the masks the step's
plan builds once per window (a `[group, H, 1, keys]` bias per decode group, `[H, n, keys]` per chunk). Soft-capped
scores and sinks cannot go through `scaled_dot_product_attention`, which has no hook between the product and the
softmax: those layers run the same masks through the eager formula (the one transformers' eager attention
computes; a sink is one more column of the softmax, dropped after it).

A sequence whose queries lie in a non-causal span this step attends as a chunk over its gathered pages, one
token or many, with each query's visible interval written into its mask.

A cache in another dtype than the model's (or scaled) is read back converted as it is gathered; a fresh prompt's
own K/V take the same round trip, so that it sees what a later step reads from the pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from engine.attention.base import (
    AttentionBackend,
    AttentionFeature,
    StepMetadata,
    from_cache,
    is_float8,
    to_cache,
    write_kv,
)

_GROUP_PAD_LIMIT = 1.25
"""A decode group's longest sequence may have at most this many times the pages of its shortest."""


@dataclass
class _Chunk:
    q_start: int
    q_end: int
    k_start: int  # offset of the first visible key in the gathered buffer; -1: attend to the fresh K/V only
    k_len: int
    mask: torch.Tensor | None
    """[n, k_len] boolean (True: may attend) over cached history, or [H, n, k_len] additive with ALiBi biases;
    None: plainly causal over the chunk's own K/V."""


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # [b] packed-row index of each sequence's query
    pages: torch.Tensor  # [b * max_pages] pages to gather, padded with page 0
    mask: torch.Tensor
    """[b, 1, 1, max_pages * page_size] additive: 0 where the query may look, -inf elsewhere; with ALiBi
    [b, Hkv, H / Hkv, max_pages * page_size], each head's biases added."""


@dataclass
class _Plan:
    chunk_pages: torch.Tensor  # all pages the chunks read, chunk after chunk
    chunks: list[_Chunk]
    groups: list[_DecodeGroup]
    alibi_slopes: torch.Tensor | None
    """Held so that its id, part of the plan's key, cannot be reused by another tensor within the step."""


@dataclass(frozen=True)
class _Attention:
    """A layer's arguments beyond the step: how scores are formed and how the cache is read."""

    scale: float
    softcap: float | None
    sinks: torch.Tensor | None
    k_scale: float
    v_scale: float

    @property
    def eager(self) -> bool:
        """Soft-capping and sinks need the eager formula: SDPA has no hook between the product and the softmax."""
        return self.softcap is not None or self.sinks is not None

    def read(self, kv: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered cache rows in the model's dtype."""
        return from_cache(kv[0], dtype, self.k_scale), from_cache(kv[1], dtype, self.v_scale)


@dataclass
class _Visible:
    """The keys one sequence sees this step, as a page range and offsets inside it."""

    first_page: int
    last_page: int
    first_key: int  # absolute position of the first visible key

    @property
    def num_pages(self) -> int:
        return self.last_page - self.first_page + 1


def _visible(n: int, total: int, window: int | None, page_size: int) -> _Visible:
    first_query = total - n
    first_key = 0 if window is None else max(0, first_query - window + 1)
    return _Visible(first_key // page_size, (total - 1) // page_size, first_key)


def _query_bounds(n: int, total: int, window: int | None, intervals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each of a sequence's last `n` queries, `[lo, hi)`: the keys it sees (engine/attention/base.py): causal
    within the window, or for a query in a span its row of `intervals` (`[n, 2]`, the metadata's)."""
    query_pos = np.arange(total - n, total)
    lo = np.zeros(n, np.int64) if window is None else np.maximum(query_pos - window + 1, 0)
    hi = query_pos + 1
    inside = intervals[:, 0] < intervals[:, 1]
    return np.where(inside, intervals[:, 0], lo), np.where(inside, intervals[:, 1], hi)


def _from_host(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` as a tensor on `device`; on CUDA staged in pinned memory, so building it never stalls the host."""
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def _gather(kv_cache: tuple[torch.Tensor, torch.Tensor], pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of whole pages, page after page: two `[len(pages) * page_size, Hkv, D]` copies (one, both K and V, where
    the cache's K and V are one tensor: a latent layer's)."""
    num_pages, _, kv_heads, dim = kv_cache[0].shape
    stored = kv_cache[0].dtype
    # torch selects float8 rows only as the bytes they are.
    as_bytes = torch.uint8 if is_float8(stored) else stored

    def pages_of(cache: torch.Tensor) -> torch.Tensor:
        return cache.view(as_bytes).view(num_pages, -1).index_select(0, pages).view(stored).view(-1, kv_heads, dim)

    keys = pages_of(kv_cache[0])
    return keys, keys if kv_cache[1] is kv_cache[0] else pages_of(kv_cache[1])


def _alibi_bias(slopes: torch.Tensor, distance: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """`slopes[h] * distance` ([H, *distance.shape], float32) where `allowed`, -inf elsewhere."""
    bias = slopes.view(-1, *([1] * distance.dim())) * distance.to(torch.float32)
    return bias.masked_fill(~allowed, float("-inf"))


def _eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Eager attention: `q [..., m, D]` over `k, v [..., L, D]`; `mask` broadcasts to `[..., m, L]`, boolean
    (True: may attend) or additive; `sinks` to `[..., m, 1]`, one more logit in each row's softmax. The order of
    operations is transformers' own (gpt-oss's for sinks)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        sink_column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1, dtype=torch.float32)
        probs = probs[..., :-1].to(q.dtype)
    return torch.matmul(probs, v)


class TorchPagedBackend(AttentionBackend):
    name = "torch"
    features = frozenset(AttentionFeature)
    kv_cache_dtypes: ClassVar[dict[torch.dtype, frozenset[torch.dtype]]] = {
        model: frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn})
        for model in (torch.float32, torch.bfloat16, torch.float16)
    }

    def _plan(
        self,
        meta: StepMetadata,
        window: int | None,
        dtype: torch.dtype,
        alibi_slopes: torch.Tensor | None,
        kv_heads: int,
    ) -> _Plan:
        """The plan depends on the window size and the ALiBi slopes only, so layers sharing them reuse it."""
        key = (window, None if alibi_slopes is None else id(alibi_slopes))
        plan = meta.backend_state.get(key)
        if plan is None:
            plan = self._build_plan(meta, window, dtype, alibi_slopes, kv_heads)
            meta.backend_state[key] = plan
        return plan

    @staticmethod
    def _build_plan(
        meta: StepMetadata,
        window: int | None,
        dtype: torch.dtype,
        alibi_slopes: torch.Tensor | None = None,
        kv_heads: int = 1,
    ) -> _Plan:
        ps = meta.page_size
        device = meta.positions.device
        tables = meta.page_tables_host
        chunk_pages: list[int] = []
        chunks: list[_Chunk] = []
        decodes: list[tuple[int, int, _Visible]] = []  # (sequence, total, visible)
        all_spans = meta.noncausal_spans_host
        for i, (n, total) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
            q_start = meta.query_start_loc_host[i]
            spans = all_spans[i] if all_spans is not None else ()
            if spans:
                chunks.append(TorchPagedBackend._span_chunk(meta, i, window, alibi_slopes, dtype, chunk_pages))
                continue
            if total == n and (window is None or n <= window):
                mask = None
                if alibi_slopes is not None:
                    pos = torch.arange(n, device=device)
                    distance = pos[None, :] - pos[:, None]
                    mask = _alibi_bias(alibi_slopes, distance, distance <= 0).to(dtype)
                chunks.append(_Chunk(q_start, q_start + n, -1, n, mask))
                continue
            vis = _visible(n, total, window, ps)
            if n == 1:
                decodes.append((i, total, vis))
                continue
            k_start = len(chunk_pages) * ps + vis.first_key - vis.first_page * ps
            chunk_pages.extend(tables[i][vis.first_page : vis.last_page + 1])
            query_pos = torch.arange(total - n, total, device=device)[:, None]
            key_pos = torch.arange(vis.first_key, total, device=device)[None, :]
            mask = key_pos <= query_pos
            if window is not None:
                mask &= key_pos > query_pos - window
            if alibi_slopes is not None:
                mask = _alibi_bias(alibi_slopes, key_pos - query_pos, mask).to(dtype)
            chunks.append(_Chunk(q_start, q_start + n, k_start, total - vis.first_key, mask))
        groups = TorchPagedBackend._group_decodes(meta, decodes, device, dtype, alibi_slopes, kv_heads)
        return _Plan(_from_host(np.asarray(chunk_pages, dtype=np.int64), device), chunks, groups, alibi_slopes)

    @staticmethod
    def _span_chunk(
        meta: StepMetadata,
        i: int,
        window: int | None,
        alibi_slopes: torch.Tensor | None,
        dtype: torch.dtype,
        chunk_pages: list[int],
    ) -> _Chunk:
        """Sequence `i`'s queries over its gathered pages, each seeing its own interval of keys; appends the pages
        to `chunk_pages`."""
        ps, device = meta.page_size, meta.positions.device
        n, total = meta.query_lens_host[i], meta.seq_lens_host[i]
        q_start = meta.query_start_loc_host[i]
        assert meta.token_spans_host is not None, "a step with spans has their intervals"
        lo, hi = _query_bounds(n, total, window, meta.token_spans_host[q_start : q_start + n])
        first_key = int(lo.min())
        first_page = first_key // ps
        k_start = len(chunk_pages) * ps + first_key - first_page * ps
        chunk_pages.extend(meta.page_tables_host[i][first_page : (total - 1) // ps + 1])
        key_pos = np.arange(first_key, total)[None, :]
        mask = _from_host((key_pos >= lo[:, None]) & (key_pos < hi[:, None]), device)
        if alibi_slopes is not None:
            distance = _from_host(key_pos - np.arange(total - n, total)[:, None], device)
            mask = _alibi_bias(alibi_slopes, distance, mask).to(dtype)
        return _Chunk(q_start, q_start + n, k_start, total - first_key, mask)

    @staticmethod
    def _group_decodes(
        meta: StepMetadata,
        decodes: list[tuple[int, int, _Visible]],
        device: torch.device,
        dtype: torch.dtype,
        alibi_slopes: torch.Tensor | None,
        kv_heads: int,
    ) -> list[_DecodeGroup]:
        ps = meta.page_size
        decodes.sort(key=lambda d: d[2].num_pages)
        groups = []
        start = 0
        while start < len(decodes):
            limit = decodes[start][2].num_pages * _GROUP_PAD_LIMIT
            end = start + 1
            while end < len(decodes) and decodes[end][2].num_pages <= limit:
                end += 1
            members = decodes[start:end]
            width = members[-1][2].num_pages
            # Built with numpy on the host (a few microseconds), then handed to torch in one piece per tensor.
            pages = np.zeros((len(members), width), dtype=np.int64)  # padding reads page 0, masked out
            key_from = np.empty((len(members), 1), dtype=np.int64)
            key_to = np.empty((len(members), 1), dtype=np.int64)
            for row, (i, total, vis) in enumerate(members):
                own = meta.page_tables_host[i][vis.first_page : vis.last_page + 1]
                pages[row, : len(own)] = own
                key_from[row] = vis.first_key - vis.first_page * ps
                key_to[row] = total - vis.first_page * ps
            key_pos = np.arange(width * ps)
            visible = (key_pos >= key_from) & (key_pos < key_to)
            if alibi_slopes is None:
                # Additive, in the query's dtype: SDPA would otherwise turn a boolean mask into one on every layer.
                additive = np.where(visible, np.float32(0.0), np.float32(-np.inf))
                mask = _from_host(additive, device).to(dtype)[:, None, None, :]
            else:
                # Each query is its sequence's last token, the key in column `key_to - 1`.
                distance = _from_host(key_pos - (key_to - 1), device)
                bias = _alibi_bias(alibi_slopes, distance, _from_host(visible, device))  # [H, b, L]
                mask = bias.transpose(0, 1).reshape(len(members), kv_heads, -1, width * ps).to(dtype)
            rows = np.fromiter((meta.query_start_loc_host[i] for i, _, _ in members), np.int64, len(members))
            groups.append(
                _DecodeGroup(rows=_from_host(rows, device), pages=_from_host(pages.reshape(-1), device), mask=mask)
            )
            start = end
        return groups

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
        plan = self._plan(meta, sliding_window, query.dtype, alibi_slopes, kv_cache[0].shape[2])
        attention = _Attention(scale, softcap, sinks, k_scale, v_scale)
        out = torch.empty_like(query)
        for group in plan.groups:
            self._decode_group(query, kv_cache, group, attention, out)
        if plan.chunks:
            # A fresh prompt reads its own K/V as the cache holds them.
            key = from_cache(to_cache(key, kv_cache[0], k_scale), key.dtype, k_scale)
            value = from_cache(to_cache(value, kv_cache[1], v_scale), value.dtype, v_scale)
            self._chunks(query, key, value, kv_cache, plan, attention, out)
        return out

    @staticmethod
    def _decode_group(
        query: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        group: _DecodeGroup,
        attention: _Attention,
        out: torch.Tensor,
    ) -> None:
        _, _, kv_heads, dim = kv_cache[0].shape
        heads = query.shape[1]
        size = group.rows.shape[0]
        # [b, Hkv, L, D] views over the gathered pages; each KV head's query group rides the query axis.
        keys, values = (
            t.view(size, -1, kv_heads, dim).transpose(1, 2)
            for t in attention.read(_gather(kv_cache, group.pages), query.dtype)
        )
        q = query.index_select(0, group.rows).view(size, kv_heads, heads // kv_heads, dim)
        if attention.eager:
            sinks = None if attention.sinks is None else attention.sinks.view(kv_heads, -1, 1)
            o = _eager_attention(q, keys, values, group.mask, attention.scale, attention.softcap, sinks)
        else:
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=group.mask, scale=attention.scale)
        out.index_copy_(0, group.rows, o.reshape(size, heads, dim))

    @staticmethod
    def _chunks(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        plan: _Plan,
        attention: _Attention,
        out: torch.Tensor,
    ) -> None:
        heads, kv_heads = query.shape[1], kv_cache[0].shape[2]
        group = heads // kv_heads
        keys, values = attention.read(_gather(kv_cache, plan.chunk_pages), query.dtype)
        for c in plan.chunks:
            if c.k_start < 0:
                k = key[c.q_start : c.q_end].transpose(0, 1)
                v = value[c.q_start : c.q_end].transpose(0, 1)
            else:
                k = keys[c.k_start : c.k_start + c.k_len].transpose(0, 1)  # [Hkv, L, D]
                v = values[c.k_start : c.k_start + c.k_len].transpose(0, 1)
            q = query[c.q_start : c.q_end].transpose(0, 1)  # [H, n, D]
            if not attention.eager:
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=c.mask, is_causal=c.mask is None, scale=attention.scale, enable_gqa=group > 1
                )
            else:
                n = c.q_end - c.q_start
                mask = c.mask
                if mask is None:
                    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
                elif mask.dim() == 3:
                    mask = mask.view(kv_heads, group, n, c.k_len)
                sinks = None if attention.sinks is None else attention.sinks.view(kv_heads, group, 1, 1)
                # [Hkv, H / Hkv, n, D]: each KV head's query heads side by side, as in the decode groups.
                q4 = q.reshape(kv_heads, group, n, q.shape[-1])
                o = _eager_attention(q4, k[:, None], v[:, None], mask, attention.scale, attention.softcap, sinks)
                o = o.reshape(heads, n, -1)
            out[c.q_start : c.q_end] = o.transpose(0, 1)
