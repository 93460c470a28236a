"""Prompt lookup (`method: ngram`): the tokens that followed the latest earlier occurrence of the sequence's last
n-gram (the latest with a whole draft after it), trying the longest n first.

Answers that repeat their input (code edits, extraction, summaries quoting the source) are full of such runs. Each
request's tokens live in one numpy array grown as its output grows, so a step's search is a few vectorised
comparisons over the sequence, not a Python loop over it.
"""

from __future__ import annotations

import numpy as np

from engine.speculative.source import DraftingRequest


class _Tokens:
    """One request's prompt + output as a growing int64 array (capacity doubled as needed)."""

    def __init__(self, prompt_ids: list[int] | tuple[int, ...]) -> None:
        self.array = np.array(prompt_ids, dtype=np.int64)
        self.length = len(prompt_ids)
        self.num_prompt = len(prompt_ids)

    def sync(self, output_ids: list[int] | tuple[int, ...]) -> np.ndarray:
        """The whole sequence, after appending the output tokens not seen yet."""
        known = self.num_prompt + len(output_ids)
        if known > self.length:
            if known > len(self.array):
                grown = np.empty(max(known, 2 * len(self.array)), dtype=np.int64)
                grown[: self.length] = self.array[: self.length]
                self.array = grown
            self.array[self.length : known] = output_ids[self.length - self.num_prompt :]
        self.length = known
        return self.array[:known]


class NgramDrafts:
    """`DraftSource` by prompt lookup over each request's own prompt and output."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: dict[str, _Tokens] = {}

    def propose(self, request: DraftingRequest, max_drafts: int) -> list[int]:
        tokens = self._tokens.get(request.request_id)
        if tokens is None:
            tokens = self._tokens[request.request_id] = _Tokens(request.prompt_ids)  # type: ignore[arg-type]
        sequence = tokens.sync(request.output_ids)  # type: ignore[arg-type]
        return lookup(sequence, self.min_n, self.max_n, max_drafts)

    def finished(self, request: DraftingRequest) -> None:
        self._tokens.pop(request.request_id, None)


def lookup(sequence: np.ndarray, min_n: int, max_n: int, max_drafts: int) -> list[int]:
    """Up to `max_drafts` tokens after the latest earlier occurrence of the sequence's last n tokens that has
    `max_drafts` tokens after it (else the earliest), for the largest n in [min_n, max_n] that occurs earlier;
    empty when none does."""
    length = len(sequence)
    if max_drafts <= 0 or length < 2:
        return []
    # Ends of earlier occurrences of the last token (each with a token after it), narrowed to those of the last 2,
    # 3, ... tokens: one scan of the sequence, then filters over the few candidates left (an occurrence of the
    # last n+1 tokens ends where one of the last n does).
    ends = np.flatnonzero(sequence[: length - 1] == sequence[-1])
    found, found_n = (ends, 1) if min_n <= 1 else (ends[:0], 0)
    for n in range(2, min(max_n, length - 1) + 1):
        ends = ends[ends >= n - 1]
        ends = ends[sequence[ends - (n - 1)] == sequence[length - n]]
        if not len(ends):
            break
        if n >= min_n:
            found, found_n = ends, n
    if not len(found):
        return []
    starts = found - (found_n - 1)
    # The latest occurrence with a whole draft after it; in a run that repeats with a short period only an early
    # occurrence has that many tokens after it.
    whole = starts[starts + found_n + max_drafts <= length]
    follow = int(whole[-1] if len(whole) else starts[0]) + found_n
    return sequence[follow : follow + max_drafts].tolist()
