"""Plain-torch paged attention: the CPU backend, and the reference the GPU backends are checked against.

Decode tokens (one query per sequence) of a step are attended in one batched SDPA call over their gathered pages.
Each multi-token chunk (a prompt, a prefill chunk, a resumed sequence) gets its own SDPA call; a chunk with no
cached history attends only to its own fresh K/V, so nothing is gathered for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, StepMetadata, write_kv


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # [Bd] packed-row index of each decode token
    slots: torch.Tensor  # [Bd, L] cache slots to gather
    mask: torch.Tensor  # [Bd, 1, 1, L] True where the key is visible


@dataclass
class _Chunk:
    start: int
    end: int
    slots: torch.Tensor | None  # None: attend only to the chunk's own fresh K/V
    mask: torch.Tensor | None  # [n, L]; None: plain causal over the fresh K/V


@dataclass
class _Plan:
    decode: _DecodeGroup | None
    chunks: list[_Chunk]


def _visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    return visible


class TorchPagedBackend(AttentionBackend):
    name = "torch"

    def _plan(self, meta: StepMetadata, window: int | None) -> _Plan:
        """Gather indices and masks depend on the window size only, so layers sharing one reuse the plan."""
        plan = meta.backend_state.get(window)
        if plan is None:
            plan = self._build_plan(meta, window)
            meta.backend_state[window] = plan
        return plan

    def _build_plan(self, meta: StepMetadata, window: int | None) -> _Plan:
        device = meta.positions.device
        ps = meta.page_size
        starts = meta.query_start_loc
        decode_seqs = [i for i, n in enumerate(meta.query_lens_host) if n == 1]
        decode = None
        if decode_seqs:
            seq_idx = torch.tensor(decode_seqs, device=device)
            lens = meta.seq_lens[seq_idx].long()
            longest = max(meta.seq_lens_host[i] for i in decode_seqs)
            span = longest if window is None else min(longest, window)
            # Each decode query sees keys [first, len); gather exactly that span (padded to the longest).
            first = (lens - span).clamp(min=0)
            key_pos = first[:, None] + torch.arange(span, device=device)[None, :]
            valid = key_pos < lens[:, None]
            key_pos = torch.where(valid, key_pos, 0)
            pages = torch.gather(meta.block_tables[seq_idx].long(), 1, key_pos // ps)
            slots = pages * ps + key_pos % ps
            decode = _DecodeGroup(rows=starts[seq_idx].long(), slots=slots, mask=valid[:, None, None, :])
        chunks = []
        for i, n in enumerate(meta.query_lens_host):
            if n == 1:
                continue
            start = int(meta.query_start_loc_host[i])
            total = meta.seq_lens_host[i]
            query_pos = torch.arange(total - n, total, device=device)
            if total == n:
                mask = None
                if window is not None and n > window:
                    mask = _visible(query_pos[:, None], query_pos[None, :], window)
                chunks.append(_Chunk(start, start + n, None, mask))
                continue
            key_pos = torch.arange(total, device=device)
            pages = meta.block_tables[i, key_pos // ps].long()
            slots = pages * ps + key_pos % ps
            chunks.append(_Chunk(start, start + n, slots, _visible(query_pos[:, None], key_pos[None, :], window)))
        return _Plan(decode, chunks)

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
        k_flat = kv_cache[0].view(-1, *kv_cache[0].shape[2:])
        v_flat = kv_cache[1].view(-1, *kv_cache[1].shape[2:])
        out = torch.empty_like(query)
        if plan.decode is not None:
            d = plan.decode
            q = query[d.rows].unsqueeze(2)  # [Bd, H, 1, D]
            k = k_flat[d.slots].transpose(1, 2)  # [Bd, Hkv, L, D]
            v = v_flat[d.slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=d.mask, scale=scale, enable_gqa=True)
            out[d.rows] = o.squeeze(2)
        for c in plan.chunks:
            q = query[c.start : c.end].transpose(0, 1)  # [H, n, D]
            if c.slots is None:
                k = key[c.start : c.end].transpose(0, 1)
                v = value[c.start : c.end].transpose(0, 1)
            else:
                k = k_flat[c.slots].transpose(0, 1)  # [Hkv, L, D]
                v = v_flat[c.slots].transpose(0, 1)
            o = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=c.mask,
                is_causal=c.mask is None and c.slots is None,
                scale=scale,
                enable_gqa=True,
            )
            out[c.start : c.end] = o.transpose(0, 1)
        return out
