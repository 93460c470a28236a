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
`DENSE_PROMPT_TOKENS` (a sequence whose every key is computed in this step) is attended by torch's causal
`scaled_dot_product_attention` over the step's own K/V, which runs its products on the CPU's bfloat16 units
(AMX tiles where present): 4.5-6x the kernel's float32 scores on a Qwen3 layer's 128- and 400-token prompts here.
Decodes and chunks over cached pages stay with the kernel, in the same call's remaining rows. The prompts' split
is computed once a step (the metadata's `backend_state`). Not where a layer needs what the kernel alone computes
(soft-capping, ALiBi, sinks, non-causal spans, a window shorter than a prompt, a cache of another dtype).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionFeature, StepMetadata, write_kv
from engine.cpu_isa import bf16_dot_products

CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

DENSE_PROMPT_TOKENS = 32
"""The shortest fresh prompt attended densely: below it the call costs more than the kernel's rows."""

DENSE_MAX_HEAD = 256
"""The widest head the dense path takes (a latent MLA head of 576 stays with the kernel's own instance)."""


@dataclass(frozen=True)
class PromptSplit:
    """A step's fresh prompts (attended densely) and the rest of its rows (the kernel's), layer-independent."""

    prompts: list[tuple[int, int]]
    """(first row, end row) of each fresh prompt of at least DENSE_PROMPT_TOKENS."""
    longest: int
    rest_rows: torch.Tensor | None
    """The other sequences' rows in the packed step (None: every sequence is a dense prompt)."""
    rest_query_start: torch.Tensor | None  # [R + 1] int32
    rest_seq_lens: torch.Tensor | None  # [R] int32
    rest_page_tables: torch.Tensor | None  # [R, pages] int32

    @classmethod
    def of(cls, meta: StepMetadata) -> PromptSplit:
        starts = meta.query_start_loc_host
        dense = [
            i
            for i, (new, length) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True))
            if new == length and new >= DENSE_PROMPT_TOKENS
        ]
        prompts = [(starts[i], starts[i + 1]) for i in dense]
        longest = max((end - first for first, end in prompts), default=0)
        rest = np.setdiff1d(np.arange(meta.num_seqs), dense)
        if not prompts or not rest.size:
            return cls(prompts, longest, None, None, None, None)
        lens = np.asarray(meta.query_lens_host)[rest]
        first = np.asarray(starts[:-1])[rest]
        rows = np.repeat(first - np.cumsum(lens) + lens, lens) + np.arange(lens.sum())
        device = meta.seq_lens.device
        index = torch.from_numpy(rest).to(device)
        return cls(
            prompts,
            longest,
            torch.from_numpy(rows).to(device),
            torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)).to(device),
            meta.seq_lens.index_select(0, index),
            meta.page_tables.index_select(0, index),
        )


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
            split = self._split(meta)
            if not split.prompts or (sliding_window is not None and split.longest > sliding_window):
                split = None
        if split is None:
            return self._paged(
                query, kv_cache, meta.query_start_loc, meta.seq_lens, meta.page_tables, scale, sliding_window,
                softcap, alibi_slopes, sinks, meta.token_spans, k_scale, v_scale,
            )  # fmt: skip
        out = torch.empty_like(query)
        for first, end in split.prompts:
            # [1, heads, L, dim]: every key of the prompt is in this step; a window at least the prompt's length
            # hides nothing from it.
            attended = F.scaled_dot_product_attention(
                query[first:end].transpose(0, 1).unsqueeze(0),
                key[first:end].transpose(0, 1).unsqueeze(0),
                value[first:end].transpose(0, 1).unsqueeze(0),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            out[first:end] = attended[0].transpose(0, 1)
        if split.rest_rows is not None:
            out[split.rest_rows] = self._paged(
                query.index_select(0, split.rest_rows), kv_cache, split.rest_query_start, split.rest_seq_lens,
                split.rest_page_tables, scale, sliding_window, None, None, None, None, k_scale, v_scale,
            )  # fmt: skip
        return out

    def attends_prompts_densely(self, meta: StepMetadata, dtype: torch.dtype) -> bool:
        """Whether layers of `dtype` attend some of this step's fresh prompts densely (those without soft-capping,
        ALiBi, sinks or a window shorter than the prompt): the fused decoder (engine/models/llama_fused.py) then
        leaves the step to the modules, whose attention calls `forward`."""
        if not (self.dense_prompts and dtype == torch.bfloat16 and meta.token_spans is None):
            return False
        return bool(self._split(meta).prompts)

    @staticmethod
    def _split(meta: StepMetadata) -> PromptSplit:
        """The step's prompt split, made by the first layer that asks and kept in the metadata for the others."""
        split = meta.backend_state.get("prompt_split")
        if split is None:
            split = meta.backend_state["prompt_split"] = PromptSplit.of(meta)
        return split

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
