"""Prompt logprobs: which packed rows score a prompt token, and each scored token's logprob and alternatives.

A request that asks for prompt logprobs gets, after the step's sampling rows, one logits row per prompt position
computed this step whose next token is a prompt token (position p's logits predict token p + 1; the last prompt
position predicts the first output token, which sampling covers).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.core.request import TokenLogprob
from engine.core.step import PromptLogprobs, SchedulerOutput
from engine.execution.input_batch import SequenceState

PromptSpan = tuple[str, int, int, int]
"""(request id, first prompt position scored, count, alternatives wanted)."""


def prompt_rows(
    plan: SchedulerOutput,
    seqs: dict[str, SequenceState],
    scoring: set[str],
    cu_q: np.ndarray,
    offset: int,
    logits_rows: np.ndarray,
) -> tuple[list[PromptSpan], list[int]]:
    """Append, from `offset` on, the packed rows whose logits score the next prompt token of each sequence in
    `scoring`; the spans (row order) and the prompt token each row scores."""
    spans: list[PromptSpan] = []
    targets: list[int] = []
    for i, request_id in enumerate(plan.request_ids):
        if request_id not in scoring:
            continue
        seq = seqs[request_id]
        prompt = seq.prompt_ids
        start, n = plan.num_computed_tokens[i], plan.num_new_tokens[i]
        count = min(start + n, len(prompt) - 1) - start
        if count <= 0:
            continue
        logits_rows[offset : offset + count] = np.arange(cu_q[i], cu_q[i] + count)
        offset += count
        spans.append((request_id, start + 1, count, seq.prompt_logprobs or 0))
        targets += prompt[start + 1 : start + 1 + count]
    return spans, targets


def score_prompts(
    logits: torch.Tensor, vocab_size: int, spans: list[PromptSpan], targets: list[int]
) -> list[PromptLogprobs]:
    """Each prompt row's logprob of its target token and its top alternatives, in one host transfer."""
    logprobs = torch.log_softmax(logits[:, :vocab_size].float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(targets, device=logprobs.device)[:, None]).squeeze(1)
    num_top = min(max(wanted for _, _, _, wanted in spans), logprobs.shape[-1])
    top = logprobs.topk(num_top, dim=-1)
    # float64 holds every token id exactly, so ids and logprobs come to the host together.
    host = torch.cat([chosen.double(), top.values.double().flatten(), top.indices.double().flatten()]).tolist()
    num_rows = len(targets)
    values, ids = host[num_rows : num_rows * (1 + num_top)], host[num_rows * (1 + num_top) :]
    results, row = [], 0
    for request_id, first, count, wanted in spans:
        entries = []
        for r in range(row, row + count):
            alternatives = [(int(ids[r * num_top + k]), values[r * num_top + k]) for k in range(wanted)]
            entries.append(TokenLogprob(targets[r], host[r], alternatives))
        results.append(PromptLogprobs(request_id, first, entries))
        row += count
    return results
