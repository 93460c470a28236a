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

Except in bfloat16 on a CPU with bfloat16 dot products (`dense_prompts`): there a fresh prompt of at least
`DENSE_PROMPT_TOKENS` tokens (a sequence whose every key is computed in this step) is attended by torch's causal
`scaled_dot_product_attention` over the step's own K/V, which runs its products on the CPU's bfloat16 units
(AMX tiles where present): 4.5-6x the kernel's float32 scores on a Qwen3 layer's 128- and 400-token prompts here.
Decodes and chunks over cached pages stay with the kernel, in the same call's remaining rows. The prompts' split
is computed once a step (engine/attention/prompt_split.py). Not where a layer needs what the kernel alone computes
(soft-capping, ALiBi, sinks, non-causal spans, a window shorter than a prompt, a cache of another dtype).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from engine.attention.base import AttentionBackend, AttentionFeature, StepMetadata, dense_attention, write_kv
from engine.attention.prompt_split import prompt_split
from engine.cpu_isa import bf16_dot_products

CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

DENSE_MAX_HEAD = 256
"""The widest head the dense path takes (a latent MLA head of 576 stays with the kernel's own instance)."""


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

    def __init__(self, kernel: Callable[..., torch.Tensor], dense_prompts: bool | None = None) -> None:
        """`kernel`: `engine.attention.cpu_kernel.load_kernel()`. `dense_prompts`: attend bfloat16 fresh prompts
        with torch's SDPA (by default where the CPU has bfloat16 dot products, whose units it runs on)."""
        self._kernel = kernel
        self.dense_prompts = bf16_dot_products() if dense_prompts is None else dense_prompts

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
        split = None
        if (
            self.dense_prompts
            and query.dtype == torch.bfloat16
            and kv_cache[0].dtype == query.dtype
            and key.shape == value.shape
            and query.shape[-1] <= DENSE_MAX_HEAD
            and softcap is None
            and alibi_slopes is None
            and sinks is None
            and meta.token_spans is None
        ):
            split = prompt_split(meta, self)
            if not split.prompts or (sliding_window is not None and split.longest > sliding_window):
                split = None
        if split is None:
            return self._paged(
                query, kv_cache, meta.query_start_loc, meta.seq_lens, meta.page_tables, scale, sliding_window,
                softcap, alibi_slopes, sinks, meta.token_spans, k_scale, v_scale,
            )  # fmt: skip
        out = torch.empty_like(query)
        for first, end in split.prompts:
            # Every key of the prompt is in this step; a window at least the prompt's length hides nothing from it.
            out[first:end] = dense_attention(query[first:end], key[first:end], value[first:end], scale, causal=True)
        if split.rest is not None:
            rest = split.rest
            out[split.rest_rows] = self._paged(
                query.index_select(0, split.rest_rows), kv_cache, rest.query_start_loc, rest.seq_lens,
                rest.page_tables, scale, sliding_window, None, None, None, None, k_scale, v_scale,
            )  # fmt: skip
        return out

    def attends_prompts_densely(self, meta: StepMetadata, dtype: torch.dtype) -> bool:
        """Whether layers of `dtype` attend some of this step's fresh prompts densely (those without soft-capping,
        ALiBi, sinks or a window shorter than the prompt): the fused decoder (engine/models/llama_fused.py) then
        leaves the step to the modules, whose attention calls `forward`."""
        if not (self.dense_prompts and dtype == torch.bfloat16 and meta.token_spans is None):
            return False
        return bool(prompt_split(meta, self).prompts)

    def _paged(
        self,
        query: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        page_tables: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
        alibi_slopes: torch.Tensor | None,
        sinks: torch.Tensor | None,
        token_spans: torch.Tensor | None,
        k_scale: float,
        v_scale: float,
    ) -> torch.Tensor:
        """The kernel over the given sequences' rows, reading their keys from the pages."""
        return self._kernel(
            query,
            kv_cache[0],
            kv_cache[1],
            query_start_loc,
            seq_lens,
            page_tables,
            scale,
            sliding_window or 0,
            softcap or 0.0,
            alibi_slopes,
            sinks,
            token_spans,
            k_scale,
            v_scale,
        )
