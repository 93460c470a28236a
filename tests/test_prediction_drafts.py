"""Predicted Outputs as drafts (engine/speculative/prediction.py): the prediction's continuation while the output
follows it, and drafting resumed after the model's edits (replacements, deletions, insertions, repeats).

The simulations stand in for the engine: each step proposes, then appends what the verifier would keep, the
longest prefix of the drafts that matches the true output plus one true token.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, SupportsIndex

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.speculative.prediction import MAX_ANCHOR, MIN_ANCHOR, PredictionDrafts

MAX_DRAFTS = 8


@dataclass
class FakeRequest:
    request_id: str
    prompt_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    output_ids: list[int] = field(default_factory=list)


@dataclass
class Step:
    position: int
    """Output tokens before the step's proposal."""
    drafts: list[int]
    accepted: int


def verify_step(drafts: Sequence[int], truth: Sequence[int], position: int) -> int:
    """How many drafts the verifier keeps: the longest prefix that matches the true output from `position`."""
    accepted = 0
    while (
        accepted < len(drafts) and position + accepted < len(truth) and drafts[accepted] == truth[position + accepted]
    ):
        accepted += 1
    return accepted


def simulate(prediction: Sequence[int], truth: Sequence[int], max_drafts: int = MAX_DRAFTS) -> list[Step]:
    """Generates `truth` as the engine would, drafting from `prediction`; the steps taken."""
    source = PredictionDrafts()
    source.add("r", prediction)
    request = FakeRequest("r")
    steps = []
    while len(request.output_ids) < len(truth):
        position = len(request.output_ids)
        drafts = source.propose(request, max_drafts)
        assert len(drafts) <= max_drafts
        accepted = verify_step(drafts, truth, position)
        request.output_ids.extend(truth[position : position + accepted + 1])
        steps.append(Step(position, drafts, accepted))
    source.finished(request)
    return steps


def drafted_fraction(steps: list[Step], truth: Sequence[int]) -> float:
    """Fraction of the output that came from accepted drafts (at most max_drafts / (max_drafts + 1))."""
    return sum(step.accepted for step in steps) / len(truth)


def tokens(rng: random.Random, count: int) -> list[int]:
    """Ordinary tokens of the prediction (a vocabulary of 1000: n-grams rarely repeat by chance)."""
    return [rng.randrange(1000) for _ in range(count)]


def novel(count: int, base: int = 10_000) -> list[int]:
    """Tokens the prediction never holds: the model's own text."""
    return list(range(base, base + count))


def assert_resumes(
    steps: list[Step], prediction: Sequence[int], truth: Sequence[int], edit_at: int, resume_at: int
) -> None:
    """Up to the edit (where the output leaves the prediction) the drafts are the prediction's continuation; from
    just after it until `resume_at` there are none; from `resume_at` on they are the truth's continuation again."""
    for step in steps:
        expected = list(truth[step.position : step.position + MAX_DRAFTS])
        if step.position <= edit_at:
            assert step.drafts == list(prediction[step.position : step.position + MAX_DRAFTS]), step
        elif step.position < resume_at:
            assert step.drafts == [], step
        else:
            assert step.drafts == expected, step
    assert any(step.position == resume_at for step in steps), "one token a step while not drafting"


def test_output_equal_to_prediction_drafts_its_continuation_at_every_step() -> None:
    rng = random.Random(0)
    prediction = tokens(rng, 500)
    for max_drafts in (1, 3, MAX_DRAFTS):
        steps = simulate(prediction, prediction, max_drafts)
        for step in steps:
            assert step.drafts == prediction[step.position : step.position + max_drafts]
            assert step.accepted == len(step.drafts)
        # All but the verifier's own token of each step came from drafts: the most there can be.
        assert sum(step.accepted for step in steps) >= len(prediction) - len(steps)
        assert len(steps) == -(-len(prediction) // (max_drafts + 1))
    assert drafted_fraction(simulate(prediction, prediction), prediction) > 0.88


def test_replacement_in_the_middle_resumes_after_the_edit() -> None:
    rng = random.Random(1)
    before, replaced, after = tokens(rng, 200), tokens(rng, 5), tokens(rng, 200)
    replacement = novel(6)
    truth = before + replacement + after
    prediction = before + replaced + after
    steps = simulate(prediction, truth)
    # No drafts while the replacement is written and until MIN_ANCHOR tokens after it agree with the prediction.
    assert_resumes(steps, prediction, truth, edit_at=len(before), resume_at=len(before) + len(replacement) + MIN_ANCHOR)
    assert drafted_fraction(steps, truth) > 0.85


def test_deletion_resumes_after_the_deleted_chunk() -> None:
    rng = random.Random(2)
    before, after = tokens(rng, 200), tokens(rng, 200)
    # A line or two dropped: MIN_ANCHOR tokens of agreement suffice. A long stretch dropped (300 tokens) needs 5:
    # the further the jump, the longer the anchor (3 within 32 tokens, 4 within 128, 5 within 512).
    for deleted, anchor in ((20, MIN_ANCHOR), (300, 5)):
        prediction = before + tokens(rng, deleted) + after
        truth = before + after
        steps = simulate(prediction, truth)
        assert_resumes(steps, prediction, truth, edit_at=len(before), resume_at=len(before) + anchor)
        assert drafted_fraction(steps, truth) > 0.85


def test_insertion_resumes_once_the_prediction_is_matched_again() -> None:
    rng = random.Random(3)
    before, after = tokens(rng, 200), tokens(rng, 200)
    inserted = novel(15)
    truth = before + inserted + after
    prediction = before + after
    steps = simulate(prediction, truth)
    assert_resumes(steps, prediction, truth, edit_at=len(before), resume_at=len(before) + len(inserted) + MIN_ANCHOR)
    assert drafted_fraction(steps, truth) > 0.8


def test_several_edits_each_recovered() -> None:
    rng = random.Random(4)
    chunks = [tokens(rng, 100) for _ in range(6)]
    prediction = [token for chunk in chunks for token in chunk]
    # Insert after chunk 0, replace chunk 2's start, delete chunk 4.
    truth = (
        chunks[0] + novel(7) + chunks[1] + novel(4, base=20_000) + chunks[2][3:] + chunks[3] + chunks[5]
    )  # fmt: skip
    steps = simulate(prediction, truth)
    assert drafted_fraction(steps, truth) > 0.8
    assert all(step.drafts == truth[step.position : step.position + MAX_DRAFTS] for step in steps[-10:])


def test_spurious_match_inside_an_insertion_does_not_drag_the_cursor() -> None:
    """The model's inserted text contains a few tokens that occur shortly ahead in the prediction, and the
    prediction's next tokens recur just after them: drafting must resume where the model left the prediction,
    not after the chance match."""
    rng = random.Random(5)
    before, after = tokens(rng, 100), tokens(rng, 100)
    after[20:23] = after[0:3]
    inserted = novel(5) + after[10:13] + novel(5, base=20_000)
    truth = before + inserted + after
    steps = simulate(before + after, truth)
    resume_at = len(before) + len(inserted) + MIN_ANCHOR
    resumed = next(step for step in steps if step.position == resume_at)
    assert resumed.drafts == truth[resume_at : resume_at + MAX_DRAFTS]
    later = [step for step in steps if step.position > resume_at]
    assert all(step.drafts == truth[step.position : step.position + MAX_DRAFTS] for step in later)


def test_repeated_content_is_found_behind_the_cursor() -> None:
    """The model writes its last ten tokens again: a bounded backward search picks the prediction up there."""
    rng = random.Random(6)
    before, after = tokens(rng, 100), tokens(rng, 100)
    truth = before + before[-10:] + after
    prediction = before + after
    steps = simulate(prediction, truth)
    assert_resumes(steps, prediction, truth, edit_at=len(before), resume_at=len(before) + MIN_ANCHOR)


def test_nearest_forward_occurrence_is_preferred() -> None:
    """Repeated blocks: after an insertion the output's tail occurs at two places ahead; the nearer is right."""
    rng = random.Random(7)
    head, block, middle, tail = tokens(rng, 50), tokens(rng, 12), tokens(rng, 40), tokens(rng, 50)
    prediction = head + block + middle + block + tail
    truth = head + novel(6) + block + middle + block + tail
    steps = simulate(prediction, truth)
    assert_resumes(steps, prediction, truth, edit_at=len(head), resume_at=len(head) + 6 + MIN_ANCHOR)


def test_far_jump_needs_a_longer_anchor() -> None:
    """A few tokens that agree with a place far ahead are not enough to jump there; a line's worth is."""
    rng = random.Random(8)
    prediction = tokens(rng, 10_000)
    target = 9_000  # ~9000 tokens past where the output left the prediction: beyond 8192, MAX_ANCHOR needed
    source = PredictionDrafts()
    source.add("r", prediction)
    request = FakeRequest("r", output_ids=[*prediction[:10], *novel(4)])
    assert source.propose(request, 4) == []
    for agreeing in range(1, MAX_ANCHOR):
        request.output_ids.append(prediction[target + agreeing - 1])
        assert source.propose(request, 4) == [], agreeing
    request.output_ids.append(prediction[target + MAX_ANCHOR - 1])
    assert source.propose(request, 4) == prediction[target + MAX_ANCHOR : target + MAX_ANCHOR + 4]


def test_no_prediction_gets_no_drafts() -> None:
    source = PredictionDrafts()
    request = FakeRequest("plain", output_ids=[5, 6, 7])
    assert source.propose(request, MAX_DRAFTS) == []
    source.finished(request)  # nothing kept, nothing to drop
    source.add("empty", [])
    assert source.propose(FakeRequest("empty"), MAX_DRAFTS) == []
    source.add("other", [5, 6, 7, 8])
    assert source.propose(request, MAX_DRAFTS) == []


def test_max_drafts_respected() -> None:
    source = PredictionDrafts()
    prediction = list(range(100, 120))
    source.add("r", prediction)
    request = FakeRequest("r")
    for most in range(12):
        assert source.propose(request, most) == prediction[:most]
    request.output_ids.extend(prediction[:15])
    assert source.propose(request, MAX_DRAFTS) == prediction[15:]
    request.output_ids.extend(prediction[15:])
    assert source.propose(request, MAX_DRAFTS) == []
    request.output_ids.extend([1, 2, 3, 4])  # writing on past the prediction's end
    assert source.propose(request, MAX_DRAFTS) == []


def test_finished_drops_state() -> None:
    source = PredictionDrafts()
    source.add("r", [10, 11, 12, 13, 14])
    request = FakeRequest("r", output_ids=[10, 11])
    assert source.propose(request, 2) == [12, 13]
    source.finished(request)
    assert source.propose(request, 2) == []
    source.finished(request)
    # The same id again starts afresh.
    source.add("r", [20, 21, 22])
    assert source.propose(FakeRequest("r"), 2) == [20, 21]


def test_output_cut_back_starts_over() -> None:
    source = PredictionDrafts()
    source.add("r", [10, 11, 12, 13, 14])
    request = FakeRequest("r", output_ids=[10, 11, 12])
    assert source.propose(request, 2) == [13, 14]
    request.output_ids = [10]
    assert source.propose(request, 2) == [11, 12]


class ReadCounter(list[int]):
    """An output list that counts the tokens read from it."""

    reads = 0

    def __getitem__(self, key: SupportsIndex | slice) -> Any:
        value = super().__getitem__(key)
        self.reads += len(value) if isinstance(key, slice) else 1
        return value

    def __iter__(self) -> Iterator[int]:
        for token in super().__iter__():
            self.reads += 1
            yield token


def test_each_step_reads_only_the_new_output_and_a_short_tail() -> None:
    rng = random.Random(9)
    chunks = [tokens(rng, 300) for _ in range(4)]
    prediction = [token for chunk in chunks for token in chunk]
    truth = chunks[0] + novel(30) + chunks[1] + chunks[3]
    source = PredictionDrafts()
    source.add("r", prediction)
    request = FakeRequest("r", output_ids=ReadCounter())
    num_steps = 0
    while len(request.output_ids) < len(truth):
        num_steps += 1
        position = len(request.output_ids)
        accepted = verify_step(source.propose(request, MAX_DRAFTS), truth, position)
        request.output_ids.extend(truth[position : position + accepted + 1])
    # Re-reading the output each step would be ~ num_steps * len(truth) / 2 reads.
    assert request.output_ids.reads <= len(truth) + num_steps * 2 * MAX_ANCHOR


@st.composite
def edited(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """A prediction over a small vocabulary (n-grams repeat, as in code) and an output made from it by a few
    replacements, insertions and deletions."""
    vocabulary = st.integers(0, 5)
    prediction = draw(st.lists(vocabulary, max_size=60))
    truth = list(prediction)
    for _ in range(draw(st.integers(0, 4))):
        start = draw(st.integers(0, len(truth)))
        end = draw(st.integers(start, min(len(truth), start + 8)))
        truth[start:end] = draw(st.lists(st.integers(0, 7), max_size=8))
    return prediction, truth


@settings(max_examples=300, deadline=None)
@given(edited(), st.data())
def test_proposals_are_the_prediction_after_a_place_the_output_tail_matches(
    case: tuple[list[int], list[int]], data: st.DataObject
) -> None:
    prediction, truth = case
    source = PredictionDrafts()
    source.add("r", prediction)
    request = FakeRequest("r")
    while True:
        output = request.output_ids
        most = data.draw(st.integers(0, 10))
        drafts = source.propose(request, most)
        assert len(drafts) <= most
        if prediction[: len(output)] == output:
            # Never left the prediction: its continuation.
            assert drafts == prediction[len(output) : len(output) + most]
        elif drafts:
            # A contiguous slice of the prediction, as long as allowed, right after a place that agrees with the
            # output's last MIN_ANCHOR tokens (or all of them, if fewer).
            anchor = min(len(output), MIN_ANCHOR)
            assert any(
                prediction[cursor - anchor : cursor] == output[len(output) - anchor :]
                and drafts == prediction[cursor : cursor + most]
                for cursor in range(anchor, len(prediction))
            ), (output, drafts)
        if len(output) == len(truth):
            break
        # The engine appends what the verifier keeps, or (another source's step, a chunk) several tokens at once.
        verifier = data.draw(st.booleans())
        grow = verify_step(drafts, truth, len(output)) + 1 if verifier else data.draw(st.integers(1, 5))
        output.extend(truth[len(output) : len(output) + grow])
    source.finished(request)
