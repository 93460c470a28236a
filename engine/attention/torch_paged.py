"""Plain-torch paged attention: the CPU backend, and the reference the GPU backends are checked against.

Per layer, the pages every sequence needs are gathered in one `index_select` (whole pages: memcpy-sized copies;
advanced indexing is several times slower here), then each sequence attends over its own slice of that buffer
with no padding. A chunk with no cached history (a fresh prompt) attends only to its own K/V: nothing is
gathered for it. Decode queries need no mask at all: their slice is exactly the keys they may see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, StepMetadata, write_kv


@dataclass
class _Seq:
    q_start: int
    q_end: int
    k_start: int  # offset of the first visible key in the gathered buffer; -1: attend to the fresh K/V only
    k_len: int
    mask: torch.Tensor | None  # [n, k_len] for chunks that need one


@dataclass
class _Plan:
    pages: torch.Tensor  # all pages to gather, sequence after sequence
    seqs: list[_Seq]


class TorchPagedBackend(AttentionBackend):
    name = "torch"

    def _plan(self, meta: StepMetadata, window: int | None) -> _Plan:
        """The plan depends on the window size only, so layers sharing one reuse it within the step."""
        plan = meta.backend_state.get(window)
        if plan is None:
            plan = self._build_plan(meta, window)
            meta.backend_state[window] = plan
        return plan

    @staticmethod
    def _build_plan(meta: StepMetadata, window: int | None) -> _Plan:
        ps = meta.page_size
        device = meta.positions.device
        tables = meta.block_tables_host
        page_lists: list[list[int]] = []
        gathered = 0
        seqs = []
        for i, (n, total) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
            q_start = meta.query_start_loc_host[i]
            if total == n and (window is None or n <= window):
                seqs.append(_Seq(q_start, q_start + n, -1, n, None))
                continue
            first_query = total - n
            first_key = 0 if window is None else max(0, first_query - window + 1)
            first_page, last_page = first_key // ps, (total - 1) // ps
            page_lists.append(tables[i][first_page : last_page + 1])
            k_start = gathered + first_key - first_page * ps
            gathered += (last_page - first_page + 1) * ps
            mask = None
            if n > 1:
                query_pos = torch.arange(first_query, total, device=device)[:, None]
                key_pos = torch.arange(first_key, total, device=device)[None, :]
                mask = key_pos <= query_pos
                if window is not None:
                    mask &= key_pos > query_pos - window
            seqs.append(_Seq(q_start, q_start + n, k_start, total - first_key, mask))
        flat = [p for pages in page_lists for p in pages]
        return _Plan(torch.tensor(flat, dtype=torch.int64, device=device), seqs)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: StepMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        write_kv(key, value, kv_cache, meta.slot_mapping)
        plan = self._plan(meta, sliding_window)
        num_blocks, _, kv_heads, dim = kv_cache[0].shape
        heads = query.shape[1]
        group = heads // kv_heads
        keys = kv_cache[0].view(num_blocks, -1).index_select(0, plan.pages).view(-1, kv_heads, dim)
        values = kv_cache[1].view(num_blocks, -1).index_select(0, plan.pages).view(-1, kv_heads, dim)
        out = torch.empty_like(query)
        for s in plan.seqs:
            if s.k_start < 0:
                k = key[s.q_start : s.q_end].transpose(0, 1)
                v = value[s.q_start : s.q_end].transpose(0, 1)
            else:
                k = keys[s.k_start : s.k_start + s.k_len].transpose(0, 1)  # [Hkv, L, D]
                v = values[s.k_start : s.k_start + s.k_len].transpose(0, 1)
            if s.q_end - s.q_start == 1:
                # One query: fold each KV head's query group into the query axis (no repeated K/V, no mask).
                q = query[s.q_start].view(kv_heads, group, dim)
                o = F.scaled_dot_product_attention(q, k, v, scale=scale)
                out[s.q_start] = o.reshape(heads, dim)
                continue
            q = query[s.q_start : s.q_end].transpose(0, 1)  # [H, n, D]
            causal = s.mask is None
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=s.mask, is_causal=causal, scale=scale, enable_gqa=group > 1
            )
            out[s.q_start : s.q_end] = o.transpose(0, 1)
        return out
