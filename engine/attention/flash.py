"""flash-attn over the pages in place (GPU only): nothing is gathered into a contiguous copy.

A step with only decode tokens uses `flash_attn_with_kvcache` (one query per sequence, and the page table, which
flash-attn calls `block_table`); any step with a multi-token chunk uses `flash_attn_varlen_func` with the page
table, which serves prefill chunks over cached pages and decodes in the same call. Upstream flash-attn reads
paged K/V only when the page size is a multiple of 256, so `auto` falls back to the torch backend for smaller
pages.

Soft-capping and ALiBi are the kernels' own `softcap` (0.0 turns it off) and `alibi_slopes` ([H] float32, a bias
of `-slope * |query_position - key_position|`, which under the causal mask is the `slope * (key - query)` the
torch backend adds). flash-attn has no sinks and no per-query key intervals, and reads the cache in the query's
dtype: a model needing any of these is refused when the backend is chosen (and `forward` refuses them too).
"""

from __future__ import annotations

import importlib.util

import torch

from engine.attention.base import AttentionBackend, AttentionFeature, StepMetadata, UnsupportedAttention, write_kv

PAGE_MULTIPLE = 256
FLASH_DTYPES = (torch.float16, torch.bfloat16)
"""What flash-attn computes in."""


def flash_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


class FlashBackend(AttentionBackend):
    name = "flash"
    features = frozenset({AttentionFeature.SLIDING_WINDOW, AttentionFeature.SOFTCAP, AttentionFeature.ALIBI})

    def __init__(self, page_size: int) -> None:
        if not self.supports_page_size(page_size):
            raise ValueError(f"flash-attn reads pages whose size is a multiple of {PAGE_MULTIPLE}, got {page_size}")
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    @staticmethod
    def supports_page_size(page_size: int) -> bool:
        return page_size % PAGE_MULTIPLE == 0

    def prepare(self, meta: StepMetadata) -> None:
        seq_lens = meta.seq_lens
        cu_seqlens_k = torch.zeros(len(meta.seq_lens_host) + 1, dtype=torch.int32, device=seq_lens.device)
        torch.cumsum(seq_lens, 0, out=cu_seqlens_k[1:])
        meta.backend_state["cu_seqlens_k"] = cu_seqlens_k
        # The runner hands a column slice of its persistent table buffer; the kernels want unit-stride rows.
        meta.backend_state["page_tables"] = meta.page_tables.contiguous()

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
        if sinks is not None or meta.token_spans is not None or kv_cache[0].dtype != query.dtype or k_scale != 1.0:
            raise UnsupportedAttention(
                "attention_backend='flash' computes no sinks, no non-causal spans and no cache of another dtype"
            )
        write_kv(key, value, kv_cache, meta.slot_mapping)
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        if meta.max_query_len == 1:
            out = self._with_kvcache(
                query.unsqueeze(1),
                kv_cache[0],
                kv_cache[1],
                cache_seqlens=meta.seq_lens,
                block_table=meta.backend_state["page_tables"],
                softmax_scale=scale,
                causal=True,
                window_size=window,
                softcap=softcap or 0.0,
                alibi_slopes=alibi_slopes,
            )
            return out.squeeze(1)
        return self._varlen(
            query,
            kv_cache[0],
            kv_cache[1],
            cu_seqlens_q=meta.query_start_loc,
            cu_seqlens_k=meta.backend_state["cu_seqlens_k"],
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale,
            causal=True,
            window_size=window,
            softcap=softcap or 0.0,
            alibi_slopes=alibi_slopes,
            block_table=meta.backend_state["page_tables"],
        )
