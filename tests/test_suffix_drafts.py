"""Suffix decoding's draft source (engine/speculative/suffix.py): its drafts on text that repeats, within a
request and across requests; where its confidence stops a draft; a brute-force reference it must agree with on
random token sequences; growth by several tokens at once; the cache's bound and eviction; no state left behind."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.speculative.suffix import ROUNDING_SLACK, SuffixDrafts, _Node, _SuffixTrie, _Tail


@dataclass
class FakeRequest:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)


def _finish(drafts: SuffixDrafts, request_id: str, output: list[int]) -> None:
    drafts.finished(FakeRequest(request_id, [0], list(output)))


# A small vocabulary makes repeats, ties and deep shared branches common.
tokens = st.lists(st.integers(0, 3), max_size=50)
outputs = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), max_size=4)
settings_ = st.fixed_dictionaries(
    {
        "max_tree_depth": st.integers(2, 8),
        "min_token_prob": st.sampled_from([0.0, 0.1, 0.3, 0.5, 0.6]),
        "max_spec_factor": st.sampled_from([0.5, 1.0, 2.0]),
        "max_spec_offset": st.sampled_from([0.0, 1.0]),
    }
)


def test_repeating_text_drafts_its_continuation() -> None:
    phrase = list(range(10, 20))
    drafts = SuffixDrafts()
    request = FakeRequest("r", phrase * 3, phrase[:4])
    assert drafts.propose(request, 5) == phrase[4:9]
    request.output_ids += phrase[4:6]
    assert drafts.propose(request, 3) == phrase[6:9]
    # Whole periods since: the draft wraps around into the next one.
    request.output_ids += phrase[6:]
    assert drafts.propose(request, 8) == phrase[:8]


def test_a_finished_requests_output_is_drafted_from_in_a_later_request() -> None:
    tool_call = list(range(50, 70))
    drafts = SuffixDrafts()
    _finish(drafts, "earlier", [1, 2, *tool_call, 3])
    later = FakeRequest("later", [90, 91, 92], tool_call[:6])
    assert drafts.propose(later, 5) == tool_call[6:11]
    # It follows the request as it grows, by one token or several.
    later.output_ids += tool_call[6:9]
    assert drafts.propose(later, 5) == tool_call[9:14]
    # Without the cache nothing matches.
    assert SuffixDrafts(max_cached_requests=0).propose(later, 5) == []


def test_drafts_stop_where_the_continuation_branches() -> None:
    """After [1, 2, 3, 4] came [5, 6, 7] every time, then one of 12 tokens (each 1/12 < 0.1 likely)."""
    prompt: list[int] = []
    for branch in range(12):
        prompt += [1, 2, 3, 4, 5, 6, 7, 100 + branch, 200 + branch]
    request = FakeRequest("r", [*prompt, 1, 2, 3, 4])
    assert SuffixDrafts().propose(request, 8) == [5, 6, 7]
    # With a lower bar it goes on past the branch, to the latest of the tied continuations.
    assert SuffixDrafts(min_token_prob=0.05, max_spec_offset=4).propose(request, 8) == [5, 6, 7, 111, 211, 1, 2, 3]
    # Two equally likely continuations (the latest drafted): drafted up to a bar of 0.5, not above.
    two_ways = FakeRequest("r", [1, 2, 3, 8, 9, 1, 2, 3, 7, 5, 1, 2, 3])
    assert SuffixDrafts().propose(two_ways, 8) == [7, 5, 1]
    assert SuffixDrafts(min_token_prob=0.5).propose(two_ways, 8) == [7, 5, 1]
    assert SuffixDrafts(min_token_prob=0.6).propose(two_ways, 8) == []


def test_new_text_drafts_nothing() -> None:
    drafts = SuffixDrafts()
    _finish(drafts, "earlier", list(range(100, 140)))
    assert drafts.propose(FakeRequest("r", list(range(40))), 5) == []


@settings(max_examples=150, deadline=None)
@given(sequence=tokens, cached=outputs, max_drafts=st.integers(0, 10), config=settings_)
def test_drafts_never_exceed_max_drafts(
    sequence: list[int], cached: list[list[int]], max_drafts: int, config: dict[str, Any]
) -> None:
    drafts = SuffixDrafts(**config)
    for index, output in enumerate(cached):
        _finish(drafts, f"c{index}", output)
    assert len(drafts.propose(FakeRequest("r", sequence), max_drafts)) <= max_drafts


@settings(max_examples=150, deadline=None)
@given(
    prompt=tokens,
    growth=st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=5), st.booleans()), max_size=12),
    cached=outputs,
    max_drafts=st.integers(1, 8),
    config=settings_,
)
def test_growing_by_chunks_drafts_as_a_request_seen_whole(
    prompt: list[int],
    growth: list[tuple[list[int], bool]],
    cached: list[list[int]],
    max_drafts: int,
    config: dict[str, Any],
) -> None:
    """Grown a few tokens at a time, with requests finishing in between (the cache changes under it), a request
    gets the drafts a new source, told of the same finished requests, gives the whole sequence at once."""
    drafts = SuffixDrafts(**config)
    request = FakeRequest("r", prompt)
    finished: list[list[int]] = []
    pending = list(cached)
    for chunk, finish_one in growth:
        if finish_one and pending:
            finished.append(pending.pop())
            _finish(drafts, f"c{len(finished)}", finished[-1])
        request.output_ids += chunk
        fresh = SuffixDrafts(**config)
        for index, output in enumerate(finished):
            _finish(fresh, f"c{index + 1}", output)
        whole = FakeRequest("whole", prompt, list(request.output_ids))
        assert drafts.propose(request, max_drafts) == fresh.propose(whole, max_drafts)


def _occurrences(sequences: Sequence[Sequence[int]], string: Sequence[int]) -> list[tuple[int, int]]:
    """(sequence, start) of each occurrence of `string`, in the order they were counted."""
    n = len(string)
    return [
        (index, start)
        for index, sequence in enumerate(sequences)
        for start in range(len(sequence) - n + 1)
        if list(sequence[start : start + n]) == list(string)
    ]


def _reference_draft(
    sequences: Sequence[Sequence[int]], context: Sequence[int], max_tokens: int, min_prob: float, depth: int
) -> tuple[list[int], float]:
    """The draft `_draft` should give, by counting occurrences directly: the most frequent next token (ties: the
    latest occurrence), while the product of count(next) / count(continued) stays at least `min_prob`; strings
    cut at `depth` tokens. Past a string that occurred once, the rest of that occurrence at the same probability
    (summed as the implementation does, so that scores compare exactly)."""
    string = list(context)
    drafted: list[int] = []
    score, probability = 0.0, 1.0

    def rest_of(occurrence: tuple[int, int], consumed: int) -> list[int]:
        index, start = occurrence
        sequence = sequences[index]
        end = min(start + depth, len(sequence), start + consumed + max_tokens - len(drafted))
        return list(sequence[start + consumed : end])

    occurrences = _occurrences(sequences, string)
    if len(occurrences) == 1:
        rest = rest_of(occurrences[0], len(string))
        return rest, probability * len(rest)
    while len(drafted) < max_tokens and len(string) < depth:
        follow: dict[int, list[tuple[int, int]]] = {}
        for index, start in occurrences:
            if start + len(string) < len(sequences[index]):
                follow.setdefault(sequences[index][start + len(string)], []).append((index, start))
        if not follow:
            break
        token = max(follow, key=lambda t: (len(follow[t]), follow[t][-1]))
        probability *= len(follow[token]) / sum(len(starts) for starts in follow.values())
        if probability < min_prob:
            break
        if len(follow[token]) == 1:
            rest = rest_of(follow[token][0], len(string))
            drafted += rest
            score += probability * len(rest)
            break
        drafted.append(token)
        score += probability
        string.append(token)
        occurrences = follow[token]
    return drafted, score


def _reference_proposal(
    sequence: list[int], cached: list[list[int]], max_drafts: int, config: dict[str, Any]
) -> list[int]:
    """Every context length, longest first, in the request's own tokens (where it occurred before) and then in
    the cache; the highest score wins, earlier on ties."""
    depth = config["max_tree_depth"]
    best: tuple[list[int], float] = ([], 0.0)
    # The request's own context must have occurred before its latest occurrence; the cache's, anywhere.
    for sources, longest, needed in (([sequence], depth - 1, 2), (cached, depth, 1)):
        for length in range(min(longest, len(sequence)), 0, -1):
            context = sequence[len(sequence) - length :]
            if len(_occurrences(sources, context)) < needed:
                continue
            cap = int(length * config["max_spec_factor"] + config["max_spec_offset"] + ROUNDING_SLACK)
            draft = _reference_draft(sources, context, min(max_drafts, cap), config["min_token_prob"], depth)
            if draft[1] > best[1]:
                best = draft
    return best[0]


@settings(max_examples=200, deadline=None)
@given(prompt=tokens, output=tokens, cached=outputs, max_drafts=st.integers(0, 8), config=settings_)
def test_drafts_match_a_brute_force_reference(
    prompt: list[int], output: list[int], cached: list[list[int]], max_drafts: int, config: dict[str, Any]
) -> None:
    drafts = SuffixDrafts(**config)
    for index, finished in enumerate(cached):
        _finish(drafts, f"c{index}", finished)
    request = FakeRequest("r", prompt)
    for grown in range(0, len(output) + 1, 7):
        request.output_ids = output[:grown]
        expected = _reference_proposal(prompt + output[:grown], cached, max_drafts, config)
        assert drafts.propose(request, max_drafts) == expected
        # The cache match covers no more than the trie's depth: longer would be candidates with nothing to draft.
        match = drafts._requests["r"].cache_match
        assert match.node_length <= match.length <= config["max_tree_depth"]


def _trie_counts(node: _Node, prefix: tuple[int, ...] = ()) -> dict[tuple[int, ...], tuple[int, int]]:
    """Each string in the trie below `node`: (occurrences, occurrences followed by a token)."""
    counts: dict[tuple[int, ...], tuple[int, int]] = {}
    for token, child in node.children.items():
        if isinstance(child, _Tail):
            rest = child.tokens[child.position : child.end]
            assert rest and rest[0] == token
            for n in range(1, len(rest) + 1):
                counts[prefix + tuple(rest[:n])] = (1, int(n < len(rest)))
        else:
            counts[(*prefix, token)] = (child.count, child.continued)
            counts.update(_trie_counts(child, (*prefix, token)))
    return counts


def _brute_counts(sequences: list[list[int]], depth: int) -> dict[tuple[int, ...], tuple[int, int]]:
    counts: dict[tuple[int, ...], tuple[int, int]] = {}
    for sequence in sequences:
        for start in range(len(sequence)):
            for end in range(start + 1, min(start + depth, len(sequence)) + 1):
                seen, continued = counts.get(tuple(sequence[start:end]), (0, 0))
                followed = end < len(sequence) and end - start < depth
                counts[tuple(sequence[start:end])] = (seen + 1, continued + followed)
    return counts


@settings(max_examples=150, deadline=None)
@given(
    sequences=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), max_size=8),
    max_cached=st.integers(1, 3),
    depth=st.integers(1, 6),
)
def test_the_cache_holds_exactly_the_latest_outputs(sequences: list[list[int]], max_cached: int, depth: int) -> None:
    """Evicted outputs leave no count behind: the cache's trie counts what the latest `max_cached` outputs hold,
    and every count and best child agrees with its children."""
    drafts = SuffixDrafts(max_tree_depth=depth, max_cached_requests=max_cached)
    for index, sequence in enumerate(sequences):
        _finish(drafts, f"c{index}", sequence)
        # Checked (and best children looked up, as drafts do) after each: the next eviction starts from there.
        _check_best_children(drafts._cache.root)
    kept = sequences[-max_cached:] if sequences else []
    assert list(drafts._cached_outputs) == kept
    assert _trie_counts(drafts._cache.root) == _brute_counts(kept, depth)


def _check_best_children(node: _Node) -> None:
    """Below `node`: `continued` is the children's counts summed, the best child kept has the highest count, and
    its lead is no more than it has over the runner-up."""
    assert node.continued == sum(child.count for child in node.children.values())
    kept = node.best_token
    counts = sorted((child.count for child in node.children.values()), reverse=True)
    if kept is not None:
        assert node.children[kept].count == counts[0]
        assert 0 <= node.lead <= counts[0] - (counts[1] if len(counts) > 1 else 0)
    best = node.most_frequent()
    if node.children:
        assert best is not None and node.children[best].count == counts[0]
    for child in node.children.values():
        if isinstance(child, _Node):
            _check_best_children(child)


@settings(max_examples=100, deadline=None)
@given(sequence=tokens, depth=st.integers(1, 6))
def test_a_requests_own_trie_counts_its_tokens(sequence: list[int], depth: int) -> None:
    trie = _SuffixTrie(depth)
    grown: list[int] = []
    matched: list[_Node] = []
    for token in sequence:
        grown.append(token)
        matched = trie.count_token(grown, len(grown) - 1, matched)
    assert _trie_counts(trie.root) == _brute_counts([sequence], depth)
    _check_best_children(trie.root)


def test_evicted_outputs_are_no_longer_drafted_from() -> None:
    drafts = SuffixDrafts(max_cached_requests=2)
    _finish(drafts, "oldest", list(range(50, 70)))
    later = FakeRequest("later", [90, 91, 50, 51, 52, 53])
    assert drafts.propose(later, 4) == [54, 55, 56, 57]
    _finish(drafts, "second", list(range(100, 120)))
    assert drafts.propose(later, 4) == [54, 55, 56, 57]
    _finish(drafts, "third", list(range(200, 220)))
    assert len(drafts._cached_outputs) == 2
    assert drafts.propose(later, 4) == []
    assert not set(range(50, 70)) & set(drafts._cache.root.children)


def test_finished_drops_the_requests_state() -> None:
    drafts = SuffixDrafts(max_cached_requests=0)
    for index in range(20):
        request = FakeRequest(f"r{index}", list(range(30)) * 2, [1, 2, 3])
        assert drafts.propose(request, 4)
        drafts.finished(request)
    assert drafts._requests == {}
    assert drafts._cache.root.children == {}
    # A request finished without ever drafting is taken into the cache all the same.
    cached = SuffixDrafts()
    _finish(cached, "never-drafted", [7, 8, 9, 10])
    assert cached._requests == {}
    assert cached.propose(FakeRequest("r", [7, 8]), 2) == [9, 10]
