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

from collections.abc import Mapping, Sequence

import torch

from engine.core.request import SamplingParams, TokenLogprob
from engine.sampling.sampler import BatchNeeds, Sampler, SamplingState
from engine.sampling.token_masks import GrammarState


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
    grammars: Mapping[int, GrammarState] | None = None,
) -> tuple[list[list[int]], list[list[TokenLogprob] | None]]:
    """Each sequence's tokens from this step (accepted drafts, then one sampled) and their logprobs.

    `logits`: [S + D, vocab]: row i is sequence i's last known token; then, sequence by sequence, the row after each
    of its drafts (D drafts in all). `grammar_bias` covers the rows of constrained sequences, drafts' positions
    included (each masked by the grammar after the drafts before it). `grammars`: by sequence index, the grammar
    state of each constrained sequence of the step, which is walked through the tokens kept (see `_walk`).
    """
    rows: list[SamplingState] = list(sequences)
    for seq, drafted in zip(sequences, drafts, strict=True):
        rows += [_AfterDrafts(seq, drafted[:j]) for j in range(1, len(drafted) + 1)]
    sampled = sampler(logits, rows, grammar_bias, needs)
    tokens, logprobs = sampled.token_ids, sampled.logprobs
    token_ids: list[list[int]] = []
    token_logprobs: list[list[TokenLogprob] | None] = []
    bias_of_row = {row: index for index, row in enumerate(grammar_bias[0])} if grammar_bias is not None else {}
    next_row = len(sequences)
    for i, drafted in enumerate(drafts):
        positions = [i, *range(next_row, next_row + len(drafted))]
        next_row += len(drafted)
        state = grammars.get(i) if grammars else None
        if state is None:
            accepted = 0
            while accepted < len(drafted) and tokens[positions[accepted]] == drafted[accepted]:
                accepted += 1
            kept, chosen = positions[: accepted + 1], [tokens[row] for row in positions[: accepted + 1]]
        else:
            kept, chosen = _walk(state, drafted, positions, tokens)
        token_ids.append(chosen)
        if logprobs[i] is None:
            token_logprobs.append(None)
            continue
        entries = [logprobs[row] for row in kept]
        for n, (row, token) in enumerate(zip(kept, chosen, strict=True)):
            if token != tokens[row]:  # the budget closing the value replaced the sampled token
                assert grammar_bias is not None
                biased = logits[row : row + 1] + grammar_bias[1][bias_of_row[row] : bias_of_row[row] + 1]
                entries[n] = sampler.logprobs_of(biased, [token], [rows[row]])[0]
        token_logprobs.append(entries)  # type: ignore[arg-type]
    return token_ids, token_logprobs


def _walk(
    state: GrammarState, drafted: tuple[int, ...], positions: list[int], tokens: list[int]
) -> tuple[list[int], list[int]]:
    """A constrained sequence's kept rows and tokens, its grammar state advanced through them.

    Position by position as decoding without drafts goes: the budget's closing may replace the token sampled
    (`GrammarState.choose`), which then ends the step; a draft is kept while it equals the token kept there. Once
    the closing forces tokens, a later position's row was masked without knowing it: the step ends before it, with
    the drafts kept so far and no token of its own (the next step samples that position, masked only to the forced
    token, as without drafts)."""
    kept: list[int] = []
    chosen: list[int] = []
    for j, row in enumerate(positions):
        if j and state.closing is not None and state.closing.forced:
            break
        sampled = tokens[row]
        token = state.choose(sampled)
        kept.append(row)
        chosen.append(token)
        state.advance(token)
        if token != sampled or j == len(drafted) or token != drafted[j]:
            break
    return kept, chosen
