"""A step's fresh prompts apart from its other rows, for attention that computes them without the pages.

A fresh prompt is a sequence whose every key is computed in this step (no cached prefix, no earlier chunk): its
attention needs nothing but the step's own K/V, so it can run as one dense causal product, on whatever units do
that fastest, while decodes and chunks over cached pages read the pages. Two users: the CPU backend attends
bfloat16 fresh prompts with torch's SDPA (engine/attention/cpu_paged.py), and latent attention expands a fresh
prompt's keys and values from its latents instead of attending over the latent head (engine/attention/latent.py).

The split is layer-independent, made once a step by the first layer that asks (`prompt_split`, kept in the
metadata's `backend_state`); the other rows come with a `StepMetadata` of their own, a step of just those sequences
that any backend attends as it would the whole step. Only for steps without non-causal spans (a span's keys may
lie past a prompt's rows, which only the kernels' intervals express).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.base import AttentionBackend, StepMetadata

DENSE_PROMPT_TOKENS = 32
"""The shortest fresh prompt attended apart: below it a dense call costs more than the prompt's rows in the step."""


@dataclass(frozen=True)
class PromptSplit:
    """A step's fresh prompts of at least DENSE_PROMPT_TOKENS and the rest of its sequences."""

    prompts: list[tuple[int, int]]
    """(first row, end row) of each such prompt in the packed step."""
    longest: int
    prompt_rows: torch.Tensor | None
    """[P] int64: every prompt's rows, in order (None: no prompt)."""
    rest_rows: torch.Tensor | None
    """[R] int64: the other sequences' rows in the packed step (None: every sequence is such a prompt, or none is)."""
    rest: StepMetadata | None
    """The other sequences as a step of their own, their rows numbered from 0 in `rest_rows`' order."""

    @classmethod
    def of(cls, meta: StepMetadata) -> PromptSplit:
        if meta.token_spans is not None:
            raise ValueError("a step with non-causal spans is attended whole (its spans' keys may lie past a prompt)")
        starts = meta.query_start_loc_host
        dense = [
            i
            for i, (new, length) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True))
            if new == length and new >= DENSE_PROMPT_TOKENS
        ]
        prompts = [(starts[i], starts[i + 1]) for i in dense]
        if not prompts:
            return cls([], 0, None, None, None)
        device = meta.seq_lens.device
        longest = max(end - first for first, end in prompts)
        prompt_rows = torch.from_numpy(np.concatenate([np.arange(first, end) for first, end in prompts])).to(device)
        rest = np.setdiff1d(np.arange(meta.num_seqs), dense)
        if not rest.size:
            return cls(prompts, longest, prompt_rows, None, None)
        lens = np.asarray(meta.query_lens_host)[rest]
        first = np.asarray(starts[:-1])[rest]
        rows = np.repeat(first - np.cumsum(lens) + lens, lens) + np.arange(lens.sum())
        rest_rows = torch.from_numpy(rows).to(device)
        index = torch.from_numpy(rest).to(device)
        query_start = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        seq_lens = np.asarray(meta.seq_lens_host)[rest]
        step = StepMetadata(
            positions=meta.positions.index_select(0, rest_rows),
            slot_mapping=meta.slot_mapping.index_select(0, rest_rows),
            query_start_loc=torch.from_numpy(query_start).to(device),
            seq_lens=meta.seq_lens.index_select(0, index),
            page_tables=meta.page_tables.index_select(0, index),
            page_tables_host=meta.page_tables_host[rest],
            query_start_loc_host=query_start.tolist(),
            query_lens_host=lens.tolist(),
            seq_lens_host=seq_lens.tolist(),
            max_query_len=int(lens.max()),
            max_seq_len=int(seq_lens.max()),
            page_size=meta.page_size,
        )
        return cls(prompts, longest, prompt_rows, rest_rows, step)


def prompt_split(meta: StepMetadata, backend: AttentionBackend) -> PromptSplit:
    """The step's prompt split, made by the first layer that asks and kept in the metadata for the others; its
    rest prepared for `backend` (the step's)."""
    split = meta.backend_state.get("prompt_split")
    if split is None:
        split = meta.backend_state["prompt_split"] = PromptSplit.of(meta)
        if split.rest is not None:
            backend.prepare(split.rest)
    return split
