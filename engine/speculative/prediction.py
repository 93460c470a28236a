"""Predicted Outputs (`prediction: {"type": "content", ...}`): a client's guess at the answer, used as drafts.

The client sends the text it expects back, typically a file the model is asked to edit with small changes. The
server tokenizes it (`add`); each step this source proposes the predicted tokens that should come next, and the
target model verifies them (engine/sampling/verify.py), so a wrong guess costs compute, never correctness.

Alignment. The output follows the prediction for long runs, broken by the model's edits: replaced, inserted or
deleted spans. Each request keeps a cursor into the prediction, advanced incrementally (only the output tokens
that arrived since the last call are read; a call may bring several at once):

- Aligned: while each new output token equals the predicted token at the cursor, the cursor moves on, and the
  drafts are the predicted tokens from the cursor.
- Diverged: a token that differs ends the alignment; no drafts are proposed until the output's last tokens (the
  anchor) are found in the prediction again, through an index built once in `add` (each `MIN_ANCHOR`-gram of the
  prediction -> its sorted start positions). The cursor then moves to just after the anchor's match, and drafting
  resumes. A deletion (the model skipped part of the prediction) is a match ahead of where the alignment broke;
  an insertion (text the prediction lacks) finds no match until the model returns to the prediction, at the
  place it left it; a replacement is both.
- Which match: the nearest one at or after where the alignment broke (edits move forward through a file), then,
  within `BACKWARD_WINDOW` tokens, the nearest one before it (the model repeating content, or a wrong jump to
  undo). The further a match is from there, the more tokens of the output's tail must agree with the prediction
  before it: `MIN_ANCHOR` (3) within `NEAR` tokens, one more for each `REACH_FACTOR` times further, up to
  `MAX_ANCHOR` (8). Three tokens are about a dozen characters of code, specific enough near the place the model
  is editing, where a match is likely right and each token of delay is a token not drafted; but short runs such
  as `) {\\n` recur throughout a file, and the chance that one of d positions matches by accident grows with d,
  so a jump across the file needs about a line of agreement (8 tokens).
- Where searches are measured from (`origin`): the cursor at the last break of an alignment that was confirmed,
  i.e. that the output followed for `CONFIRM` tokens (its anchor included). A match found on a few common tokens
  during an insertion and broken at once is thus not taken as progress: the next search still starts where the
  model left the prediction, where it will most likely return.

Each search looks at no more than `MAX_CANDIDATES` positions each way and compares at most `MAX_ANCHOR` tokens at
each, so a step costs the same however long the prediction is.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from engine.speculative.source import DraftingRequest

MIN_ANCHOR = 3
"""Output tokens that must agree with the prediction for drafting to resume near where the alignment broke."""
MAX_ANCHOR = 8
"""Tokens of agreement needed for the furthest jumps (about a line of code)."""
NEAR = 32
"""Prediction tokens (a line or two of code) around where the alignment broke in which `MIN_ANCHOR` is enough."""
REACH_FACTOR = 4
"""Each further token of required agreement extends the reach by this factor: 3 within 32, 4 within 128, 5
within 512, ..., 8 beyond 8192."""
BACKWARD_WINDOW = 512
"""How far before the place the alignment broke a match is looked for."""
MAX_CANDIDATES = 32
"""Positions of the anchor examined in each direction per search (a common n-gram has many)."""
CONFIRM = MIN_ANCHOR + 2
"""Tokens an alignment must be followed for (anchor included) before a break of it moves the search origin: the
anchor, then two tokens drafted right."""


@dataclass(slots=True)
class _Alignment:
    """One request's prediction, its index, and where the output stands in it."""

    predicted: tuple[int, ...]
    index: dict[tuple[int, ...], list[int]]
    """Each `MIN_ANCHOR`-gram of the prediction -> its start positions, ascending."""
    consumed: int = 0
    """Output tokens read so far."""
    aligned: bool = True
    """Whether the output's last tokens follow the prediction up to `cursor` (true at the start: the prediction
    is of the whole answer)."""
    cursor: int = 0
    """When aligned: the position in the prediction of the token expected next."""
    run: int = CONFIRM
    """Output tokens the current alignment has been followed for, anchor included (the start counts as
    confirmed)."""
    origin: int = 0
    """Where searches are measured from: the cursor at the last break of a confirmed alignment."""


class PredictionDrafts:
    """`DraftSource` from each request's predicted output (requests without one get no drafts)."""

    def __init__(self) -> None:
        self._alignments: dict[str, _Alignment] = {}

    def add(self, request_id: str, predicted_ids: Sequence[int]) -> None:
        """Registers a request's predicted tokens (replacing any earlier ones); an empty prediction drafts nothing."""
        if not predicted_ids:
            self._alignments.pop(request_id, None)
            return
        predicted = tuple(predicted_ids)
        index: dict[tuple[int, ...], list[int]] = {}
        # Built once: every later search is a dict look-up and a bisection, never a scan of the prediction.
        grams = zip(*(predicted[offset:] for offset in range(MIN_ANCHOR)), strict=False)
        for start, gram in enumerate(grams):
            index.setdefault(gram, []).append(start)
        self._alignments[request_id] = _Alignment(predicted, index)

    def propose(self, request: DraftingRequest, max_drafts: int) -> list[int]:
        state = self._alignments.get(request.request_id)
        if state is None:
            return []
        output = request.output_ids
        if len(output) < state.consumed:
            # Output only grows in the engine; should it ever be cut back, start over rather than trust the state.
            state.consumed, state.aligned, state.cursor, state.run, state.origin = 0, True, 0, CONFIRM, 0
        if len(output) > state.consumed:
            self._advance(state, output)
        if not state.aligned or max_drafts <= 0:
            return []
        return list(state.predicted[state.cursor : state.cursor + max_drafts])

    def finished(self, request: DraftingRequest) -> None:
        self._alignments.pop(request.request_id, None)

    def _advance(self, state: _Alignment, output: Sequence[int]) -> None:
        """Reads the output tokens that arrived since the last call, then, if the alignment is lost, looks for it."""
        predicted = state.predicted
        if state.aligned:
            for token in output[state.consumed :]:
                if state.cursor < len(predicted) and predicted[state.cursor] == token:
                    state.cursor += 1
                    state.run += 1
                    continue
                state.aligned = False
                if state.run >= CONFIRM:
                    state.origin = state.cursor
                break  # past a break only the output's tail matters, for the search below
        state.consumed = len(output)
        if not state.aligned:
            self._realign(state, output)

    def _realign(self, state: _Alignment, output: Sequence[int]) -> None:
        """Aligns the output's tail to the nearest place in the prediction where enough of it agrees (the module
        docstring says which), if any: first at or after `origin`, then before it."""
        if len(output) < MIN_ANCHOR:
            return
        starts = state.index.get(tuple(output[len(output) - MIN_ANCHOR :]))
        if not starts:
            return
        origin = state.origin
        # Matches whose anchor ends at or after the origin count as forward: one ending right at it is the model
        # repeating the tokens before it, or returning there after an insertion (distance 0 either way).
        first = bisect_left(starts, origin - MIN_ANCHOR)
        for i in range(first, min(len(starts), first + MAX_CANDIDATES)):
            start = starts[i]
            need = _required(max(0, start - origin))
            if need > len(output):
                break  # further candidates need at least as much
            if _agrees(state.predicted, start, output, need):
                _align(state, start + MIN_ANCHOR, need)
                return
        for i in range(first - 1, max(-1, first - 1 - MAX_CANDIDATES), -1):
            start = starts[i]
            distance = origin - (start + MIN_ANCHOR)
            if distance > BACKWARD_WINDOW:
                break
            need = _required(distance)
            if need > len(output):
                break
            if _agrees(state.predicted, start, output, need):
                _align(state, start + MIN_ANCHOR, need)
                return


def _required(distance: int) -> int:
    """Output tokens that must agree with the prediction for a match this far from the origin."""
    need, reach = MIN_ANCHOR, NEAR
    while distance > reach and need < MAX_ANCHOR:
        need += 1
        reach *= REACH_FACTOR
    return need


def _agrees(predicted: tuple[int, ...], start: int, output: Sequence[int], need: int) -> bool:
    """Whether the output's last `need` tokens end the prediction's tokens up to `start + MIN_ANCHOR` (the last
    `MIN_ANCHOR` of them are known to, through the index)."""
    extra = need - MIN_ANCHOR
    if start < extra:
        return False
    tail = len(output) - MIN_ANCHOR
    return all(predicted[start - k] == output[tail - k] for k in range(1, extra + 1))


def _align(state: _Alignment, cursor: int, evidence: int) -> None:
    state.aligned = True
    state.cursor = cursor
    state.run = evidence
