"""A capturable paged-attention backend for the tests: plain torch ops over static shapes, any device.

Each query token gathers every slot its sequence's page-table row can name ([T, max_pages * page_size] keys) and
masks what it may not see (later positions, outside the window), so nothing is planned on the host and a CUDA graph
can hold it. Memory grows with tokens times the table's width: a test model's backend, not a serving one. It lets
tests/test_gpu.py capture and replay decode steps on a GPU while the engine's own capturable GPU backend is built
elsewhere; tests/test_cuda_graphs.py checks it against the torch backend on CPU.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionFeature, StepMetadata, write_kv


class DensePagedBackend(AttentionBackend):
    name = "dense-test"
    features = frozenset({AttentionFeature.SLIDING_WINDOW})
    capturable = True

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
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
        # The interface's other arguments: a model that needs them never gets this backend (its `features` lack
        # them, and a cache of the model's dtype is the only one it is given).
        if softcap is not None or alibi_slopes is not None or sinks is not None:
            raise NotImplementedError("the dense test backend has no soft-capping, ALiBi or sinks")
        write_kv(key, value, kv_cache, meta.slot_mapping)
        tokens, heads = query.shape[:2]
        page_size = meta.page_size
        device = query.device
        seq_of_token = torch.searchsorted(
            meta.query_start_loc[1:], torch.arange(tokens, device=device, dtype=torch.int32), right=True
        )
        width = meta.page_tables.shape[1] * page_size
        key_pos = torch.arange(width, device=device)
        tables = meta.page_tables.long()[seq_of_token]  # [T, max_pages]
        slots = tables[:, key_pos // page_size] * page_size + key_pos % page_size  # [T, width]
        k_cache, v_cache = (c.view(-1, *c.shape[2:]) for c in kv_cache)
        keys, values = k_cache[slots].float(), v_cache[slots].float()  # [T, width, Hkv, D]
        group = heads // keys.shape[2]
        keys = keys.repeat_interleave(group, dim=2)
        values = values.repeat_interleave(group, dim=2)
        scores = torch.einsum("thd,tkhd->thk", query.float(), keys) * scale
        query_pos = meta.positions[:, None]
        hidden = key_pos[None, :] > query_pos
        if sliding_window is not None:
            hidden |= key_pos[None, :] <= query_pos - sliding_window
        scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
        out = torch.einsum("thk,tkhd->thd", scores.softmax(dim=-1), values)
        return out.to(query.dtype)
