"""Verifying drafts: which of a sequence's drafted tokens the target model would itself have produced.

A sequence with drafts d_1..d_k got logits at its last known token and after each draft (k + 1 rows). Each row is
sampled as decoding without drafts would sample that position: with the penalties of the tokens before it (the
drafts before it included) and with the random stream of that position (the sampler's streams are keyed by the
number of tokens generated, engine/sampling/sampler.py). Drafts are accepted while each equals the token sampled
at its position; the sequence gets the accepted drafts and then the token sampled after the last of them.

Why this is exact: the tokens kept are exactly those decoding without drafts draws, position by position, since
each is drawn from the same distribution with the same stream and the same history (a rejected draft's position
keeps the token sampled there; nothing after it is kept). So greedy and seeded output is identical with and without
speculation. For a sampled request it is also the rejection rule of speculative sampling for a deterministic draft
(q one-hot at d): d is accepted with probability p(d) = min(1, p(d)/q(d)), and on rejection the token drawn is from
p restricted to the other tokens, the residual (p - q)+ normalised.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.core.request import SamplingParams, TokenLogprob
from engine.sampling.sampler import BatchNeeds, Sampler, SamplingState


class _AfterDrafts:
    """A sequence as sampling sees it at a drafted position: its output followed by the drafts before it."""

    __slots__ = ("_drafts", "_seq")

    def __init__(self, seq: SamplingState, drafts: tuple[int, ...]) -> None:
        self._seq = seq
        self._drafts = drafts

    @property
    def params(self) -> SamplingParams:
        return self._seq.params

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._seq.eos_token_ids

    @property
    def generator_seed(self) -> int:
        return self._seq.generator_seed

    @property
    def prompt_ids(self) -> Sequence[int]:
        return self._seq.prompt_ids

    @property
    def output_ids(self) -> list[int]:
        return self._seq.output_ids + list(self._drafts)

    @property
    def num_tokens(self) -> int:
        return self._seq.num_tokens + len(self._drafts)


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    sequences: Sequence[SamplingState],
    drafts: Sequence[tuple[int, ...]],
    grammar_bias: tuple[list[int], torch.Tensor] | None,
    needs: BatchNeeds,
) -> tuple[list[list[int]], list[list[TokenLogprob] | None]]:
    """Each sequence's tokens from this step (accepted drafts, then one sampled) and their logprobs.

    `logits`: [S + D, vocab]: row i is sequence i's last known token; then, sequence by sequence, the row after each
    of its drafts (D drafts in all). `grammar_bias` covers rows among the first S only: a constrained sequence has
    no drafts (engine/speculative/speculator.py).
    """
    rows: list[SamplingState] = list(sequences)
    for seq, drafted in zip(sequences, drafts, strict=True):
        rows += [_AfterDrafts(seq, drafted[:j]) for j in range(1, len(drafted) + 1)]
    sampled = sampler(logits, rows, grammar_bias, needs)
    tokens, logprobs = sampled.token_ids, sampled.logprobs
    token_ids: list[list[int]] = []
    token_logprobs: list[list[TokenLogprob] | None] = []
    next_row = len(sequences)
    for i, drafted in enumerate(drafts):
        positions = [i, *range(next_row, next_row + len(drafted))]
        next_row += len(drafted)
        accepted = 0
        while accepted < len(drafted) and tokens[positions[accepted]] == drafted[accepted]:
            accepted += 1
        kept = positions[: accepted + 1]
        token_ids.append([tokens[row] for row in kept])
        token_logprobs.append(None if logprobs[i] is None else [logprobs[row] for row in kept])  # type: ignore[misc]
    return token_ids, token_logprobs
