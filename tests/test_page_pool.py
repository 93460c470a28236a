"""PagePool: page accounting, prefix sharing, LRU eviction, sliding window. No model needed."""

from __future__ import annotations

import random
from collections.abc import Hashable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engine.core.page_pool as page_pool
from engine.core.page_pool import PagePool
from engine.core.request import ExtraKey, Request, SamplingParams


def make_request(request_id: str, prompt: list[int], max_new_tokens: int = 4) -> Request:
    return Request(
        request_id=request_id,
        prompt_ids=list(prompt),
        params=SamplingParams(max_new_tokens=max_new_tokens),
        eos_token_ids=frozenset({2}),
    )


def manager(num_pages: int = 8, page_size: int = 4, **kwargs: object) -> PagePool:
    return PagePool(num_pages, page_size, debug_checks=True, **kwargs)  # type: ignore[arg-type]


def compute_all(bm: PagePool, request: Request) -> None:
    """Admit `request` and compute its whole sequence in one go, as a single prefill would."""
    hit = bm.match_prefix(request)
    request.num_computed_tokens = hit
    assert bm.allocate(request, request.num_tokens - hit) is not None
    request.num_computed_tokens = request.num_tokens
    bm.commit(request)


def test_constructor_validates() -> None:
    with pytest.raises(ValueError):
        PagePool(0, 16)
    with pytest.raises(ValueError):
        PagePool(4, 0)
    with pytest.raises(ValueError):
        PagePool(4, 16, sliding_window=0)


def test_pages_needed_rounds_up() -> None:
    bm = manager(page_size=4)
    assert [bm.pages_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_grows_and_is_all_or_nothing() -> None:
    bm = manager(num_pages=4, page_size=4)
    a = make_request("a", list(range(10, 16)))
    assert bm.allocate(a, 6) is not None
    assert bm.page_table("a") == [0, 1]
    assert bm.num_free_pages == 2
    assert bm.usage == pytest.approx(0.5)
    a.num_computed_tokens = 6
    assert bm.allocate(a, 2) is not None  # still fits in the second page
    assert bm.page_table("a") == [0, 1]
    b = make_request("b", list(range(20, 33)))
    assert bm.allocate(b, 13) is None  # needs 4 pages, 2 free: nothing taken
    assert bm.page_table("b") == []
    assert bm.num_free_pages == 2
    assert bm.allocate(b, 8) is not None
    assert bm.num_free_pages == 0


def test_free_is_idempotent_and_returns_pages() -> None:
    bm = manager(num_pages=4, page_size=4, enable_prefix_caching=False)
    a = make_request("a", [5] * 9)
    compute_all(bm, a)
    assert bm.num_free_pages == 1
    bm.free("a")
    bm.free("a")
    bm.free("never-seen")
    assert bm.num_free_pages == 4
    assert bm.usage == 0.0
    assert bm.page_table("a") == []


def test_prefix_sharing_refcounts_and_counters() -> None:
    bm = manager(num_pages=16, page_size=4)
    system = [7, 8, 9, 10, 11, 12, 13, 14]  # two full pages
    a = make_request("a", [*system, 1, 2, 3])
    compute_all(bm, a)
    assert (bm.prefix_queries, bm.prefix_hits) == (11, 0)
    b = make_request("b", [*system, 4, 5])
    assert bm.match_prefix(b) == 8
    assert bm.page_table("b") == bm.page_table("a")[:2]
    # Counted once the admission completes, not at the lookup.
    assert (bm.prefix_queries, bm.prefix_hits) == (11, 0)
    b.num_computed_tokens = 8
    assert bm.allocate(b, 2) is not None
    assert (bm.prefix_queries, bm.prefix_hits) == (21, 8)
    shared = bm.page_table("a")[:2]
    assert [bm._refcount[p] for p in shared] == [2, 2]
    # Freeing one user keeps the shared pages referenced; freeing both leaves them cached-free.
    bm.free("a")
    assert [bm._refcount[p] for p in shared] == [1, 1]
    bm.free("b")
    assert bm.num_free_pages == 16
    c = make_request("c", [*system, 6])
    assert bm.match_prefix(c) == 8
    assert bm.page_table("c") == shared


def test_match_never_covers_the_last_token() -> None:
    bm = manager(num_pages=8, page_size=4)
    prompt = list(range(30, 38))  # exactly two pages
    compute_all(bm, make_request("a", prompt))
    again = make_request("b", prompt)
    # Both pages are cached, but the one holding the last token must be computed to get logits.
    assert bm.match_prefix(again) == 4
    one_page = make_request("c", prompt[:4])
    assert bm.match_prefix(one_page) == 0


def test_match_stops_at_the_first_miss() -> None:
    bm = manager(num_pages=8, page_size=2)
    compute_all(bm, make_request("a", [1, 2, 3, 4, 5, 6, 7]))
    # Same second page content after a different first page: the chain makes it a different page.
    b = make_request("b", [9, 9, 3, 4, 5, 6, 7])
    assert bm.match_prefix(b) == 0
    c = make_request("c", [1, 2, 3, 4, 0, 0, 7])
    assert bm.match_prefix(c) == 4


def test_match_prefix_rejects_a_request_holding_pages() -> None:
    bm = manager()
    a = make_request("a", [1, 2, 3])
    assert bm.allocate(a, 3) is not None
    with pytest.raises(ValueError):
        bm.match_prefix(a)


def test_resume_rematches_without_counting() -> None:
    bm = manager(num_pages=8, page_size=4)
    a = make_request("a", list(range(40, 50)))
    compute_all(bm, a)
    a.output_ids += [1, 2, 3]
    a.num_computed_tokens = 12  # the last output token has no K/V yet
    assert bm.allocate(a, 0) is not None
    bm.commit(a)
    counters = (bm.prefix_queries, bm.prefix_hits)
    bm.free("a")  # preempted
    a.num_computed_tokens = 0
    a.num_preemptions = 1
    assert bm.match_prefix(a) == 12  # its own pages, generated tokens included
    a.num_computed_tokens = 12
    assert bm.allocate(a, 1) is not None
    assert (bm.prefix_queries, bm.prefix_hits) == counters


def test_failed_admission_is_not_counted_and_leaks_nothing() -> None:
    bm = manager(num_pages=3, page_size=4)
    compute_all(bm, make_request("a", [*range(8), 99]))
    bm.free("a")  # its two full pages stay cached-free, the partial one is free
    hog = make_request("hog", [50])
    assert bm.allocate(hog, 1) is not None
    counters = (bm.prefix_queries, bm.prefix_hits)
    b = make_request("b", [*range(8), 1, 2, 3])
    hit = bm.match_prefix(b)
    assert hit == 8
    b.num_computed_tokens = hit
    assert bm.allocate(b, 3) is None  # needs one more page: the hit took both cached ones, hog holds the third
    bm.free("b")
    assert (bm.prefix_queries, bm.prefix_hits) == counters
    assert bm.num_free_pages == 2
    bm.free("hog")
    b.num_computed_tokens = 0
    assert bm.match_prefix(b) == 8
    b.num_computed_tokens = 8
    assert bm.allocate(b, 3) is not None
    assert (bm.prefix_queries - counters[0], bm.prefix_hits - counters[1]) == (11, 8)


def test_cached_pages_are_evicted_oldest_first() -> None:
    bm = manager(num_pages=5, page_size=2)
    compute_all(bm, make_request("a", [1, 2, 3, 4, 5]))  # [1,2] [3,4] hashed, [5] partial
    compute_all(bm, make_request("b", [6, 7, 8]))  # [6,7] hashed, [8] partial
    bm.free("a")  # tail first: [5] -> free list, then [3,4], [1,2] -> cached
    bm.free("b")  # [8] -> free list, [6,7] -> cached
    assert bm.num_free_pages == 5
    assert len(bm._cached) == 3
    # Three pages: the two free ones first, then one eviction, the oldest release: a's tail [3,4].
    assert bm.allocate(make_request("c", [20] * 6), 6) is not None
    a2 = make_request("a2", [1, 2, 3, 4, 5])
    assert bm.match_prefix(a2) == 2
    bm.free("a2")  # [1,2] released again: now the most recently used
    assert bm.allocate(make_request("d", [30]), 1) is not None  # evicts b's [6,7], older than the re-released [1,2]
    assert bm.match_prefix(make_request("b2", [6, 7, 8])) == 0
    assert bm.match_prefix(make_request("a3", [1, 2, 3])) == 2


def test_evicted_page_hash_is_dropped() -> None:
    bm = manager(num_pages=2, page_size=2)
    compute_all(bm, make_request("a", [1, 2, 3]))
    bm.free("a")
    other = make_request("o", [9, 9, 9, 9])
    assert bm.allocate(other, 4) is not None  # takes the free page and evicts the cached [1,2]
    assert bm.match_prefix(make_request("a2", [1, 2, 3])) == 0
    bm.free("a2")
    bm.check_invariants()


def test_duplicate_content_keeps_one_cached_page() -> None:
    bm = manager(num_pages=8, page_size=2)
    a = make_request("a", [1, 2, 3])
    b = make_request("b", [1, 2, 4])
    # Admitted together: neither finds the other's page, both compute [1, 2].
    assert bm.match_prefix(a) == 0
    assert bm.match_prefix(b) == 0
    for r in (a, b):
        assert bm.allocate(r, 3) is not None
        r.num_computed_tokens = 3
        bm.commit(r)
    assert len(bm._hash_to_page) == 1
    bm.free("a")
    bm.free("b")
    assert len(bm._cached) == 1
    assert bm.num_free_pages == 8


def test_commit_hashes_each_page_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []
    real = page_pool._chain_hash

    def counting(parent: int | None, tokens: tuple[int, ...], keys: tuple[Hashable, ...] = ()) -> int:
        calls.append(tokens)
        return real(parent, tokens, keys)

    monkeypatch.setattr(page_pool, "_chain_hash", counting)
    bm = manager(num_pages=16, page_size=4)
    a = make_request("a", list(range(100, 110)), max_new_tokens=20)
    assert bm.match_prefix(a) == 0
    assert bm.allocate(a, 10) is not None
    a.num_computed_tokens = 10
    bm.commit(a)
    assert len(calls) == 2  # the two full prompt pages, hashed at match and only registered at commit
    for step in range(14):  # decode: one token per step
        a.output_ids.append(200 + step)
        assert bm.allocate(a, 1) is not None
        a.num_computed_tokens += 1
        bm.commit(a)
    assert a.num_computed_tokens == 24
    assert len(calls) == 6
    assert calls[2] == (108, 109, 200, 201)  # a page straddling prompt and output


def test_pages_filled_by_decode_are_matched_by_a_follow_up() -> None:
    """A chat follow-up resends the conversation: pages completed token by token during decode must hit."""
    bm = manager(num_pages=16, page_size=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    compute_all(bm, a)
    for token in range(7, 14):  # fills [5, 6, 7, 8] across prompt and output, then [9, 10, 11, 12]
        a.output_ids.append(token)
        assert bm.allocate(a, 1) is not None
        a.num_computed_tokens += 1
        bm.commit(a)
    bm.free("a")
    follow_up = make_request("b", [*a.all_token_ids, 14])
    assert bm.match_prefix(follow_up) == 12
    other = make_request("c", [1, 2, 3, 4, 5, 6, 7, 99, 9])  # differs only in the last token of page 2
    assert bm.match_prefix(other) == 4


def test_prefix_caching_disabled() -> None:
    bm = manager(num_pages=4, page_size=2, enable_prefix_caching=False)
    compute_all(bm, make_request("a", [1, 2, 3, 4, 5]))
    bm.free("a")
    assert bm.match_prefix(make_request("b", [1, 2, 3, 4, 5])) == 0
    assert (bm.prefix_queries, bm.prefix_hits) == (0, 0)
    assert not bm._cached
    assert bm.num_free_pages == 4


def test_sliding_window_releases_pages_in_commit() -> None:
    bm = manager(num_pages=8, page_size=4, sliding_window=6)
    a = make_request("a", list(range(1, 14)))  # 13 tokens
    assert bm.match_prefix(a) == 0
    assert bm.allocate(a, 8) is not None
    a.num_computed_tokens = 8
    bm.commit(a)
    # 8 - 6 = 2: page 0 ([0, 4)) still reaches past position 2.
    assert bm.page_table("a") == [0, 1]
    assert bm.allocate(a, 5) is not None
    a.num_computed_tokens = 13
    bm.commit(a)
    # 13 - 6 = 7: page 0 lies entirely before position 7, page 1 ([4, 8)) does not.
    assert bm.page_table("a") == [-1, 1, 2, 3]
    assert bm.num_free_pages == 5
    assert bm._refcount[0] == 0
    bm.free("a")
    assert bm.num_free_pages == 8


def test_sliding_window_match_skips_pages_outside_the_window() -> None:
    bm = manager(num_pages=8, page_size=2, sliding_window=3)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    compute_all(bm, make_request("a", prompt))  # releases [1,2] and [3,4]: hashed, so they stay cached
    bm.free("a")
    b = make_request("b", prompt)
    assert bm.match_prefix(b) == 6
    # Tokens from 6 on look back at most 3 positions, to 3: pages [0, 2) ends before it, [2, 4) does not.
    table = bm.page_table("b")
    assert table[0] == -1
    assert all(p >= 0 for p in table[1:])
    assert len(table) == 3


def test_page_size_one() -> None:
    bm = manager(num_pages=10, page_size=1)
    compute_all(bm, make_request("a", [5, 6, 7, 8]))
    b = make_request("b", [5, 6, 7, 8])
    assert bm.match_prefix(b) == 3
    b.num_computed_tokens = 3
    assert bm.allocate(b, 1) is not None
    assert bm.num_free_pages == 10 - 5


def test_page_size_256() -> None:
    bm = manager(num_pages=3, page_size=256)
    prompt = list(range(600))
    a = make_request("a", prompt)
    compute_all(bm, a)
    assert len(bm.page_table("a")) == 3
    assert bm.allocate(make_request("x", [1]), 1) is None
    bm.free("a")
    b = make_request("b", [*prompt[:512], 1])
    assert bm.match_prefix(b) == 512
    c = make_request("c", prompt[:512])  # the second page holds the last token
    assert bm.match_prefix(c) == 256


def test_check_invariants_detects_corruption() -> None:
    bm = manager(num_pages=4, page_size=2)
    compute_all(bm, make_request("a", [1, 2, 3]))
    bm.check_invariants()
    bm._refcount[bm.page_table("a")[0]] += 1
    with pytest.raises(AssertionError, match="refcounts"):
        bm.check_invariants()


def test_releasing_a_page_twice_raises() -> None:
    bm = manager(num_pages=2, page_size=2)
    assert bm.allocate(make_request("a", [1]), 1) is not None
    page = bm.page_table("a")[0]
    bm._unref(page)
    with pytest.raises(AssertionError, match="released more often"):
        bm._unref(page)


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4, 16]),
    window=st.one_of(st.none(), st.integers(1, 12)),
    caching=st.booleans(),
    prompts=st.lists(
        st.lists(st.integers(3, 5), min_size=1, max_size=24),
        min_size=1,
        max_size=12,
    ),
    order=st.randoms(use_true_random=False),
)
def test_random_lifecycles_keep_accounting(
    page_size: int, window: int | None, caching: bool, prompts: list[list[int]], order: random.Random
) -> None:
    """Admit, compute in random chunks and free in random order; accounting holds after every call."""
    bm = PagePool(64, page_size, enable_prefix_caching=caching, sliding_window=window, debug_checks=True)
    live: list[Request] = []
    for i, prompt in enumerate(prompts):
        request = make_request(f"r{i}", prompt)
        request.num_computed_tokens = bm.match_prefix(request)
        assert request.num_computed_tokens < request.num_tokens
        while request.num_computed_tokens < request.num_tokens:
            n = order.randint(1, request.num_tokens - request.num_computed_tokens)
            if bm.allocate(request, n) is None:
                break
            request.num_computed_tokens += n
            bm.commit(request)
        live.append(request)
        if order.random() < 0.4:
            bm.free(live.pop(order.randrange(len(live))).request_id)
    for request in live:
        bm.free(request.request_id)
    assert bm.num_free_pages == 64
    assert bm.prefix_hits <= bm.prefix_queries


# -- extra keys: what K/V depend on besides token ids ------------------------------------------------------------


def keyed_request(request_id: str, prompt: list[int], extra_keys: tuple[ExtraKey, ...]) -> Request:
    request = make_request(request_id, prompt)
    request.extra_keys = extra_keys
    return request


def test_a_whole_request_key_separates_every_page() -> None:
    """An adapter or a cache salt covers the first token; the chain carries it to every later page."""
    bm = manager(num_pages=16, page_size=4)
    prompt = list(range(10, 23))
    compute_all(bm, keyed_request("a", prompt, (ExtraKey(0, 1, ("adapter", "x")),)))
    assert bm.match_prefix(keyed_request("b", prompt, (ExtraKey(0, 1, ("adapter", "y")),))) == 0
    assert bm.match_prefix(keyed_request("c", prompt, ())) == 0
    assert bm.match_prefix(keyed_request("d", prompt, (ExtraKey(0, 1, ("adapter", "x")),))) == 12


def test_an_image_key_separates_the_pages_it_covers_and_those_after() -> None:
    """Equal placeholder tokens, different images: the pages before the image are shared, the rest are not."""
    bm = manager(num_pages=32, page_size=4)
    prompt = [1] * 5 + [99] * 6 + list(range(30, 40))  # the image's placeholder tokens at [5, 11)
    compute_all(bm, keyed_request("a", prompt, (ExtraKey(5, 11, "image-1"),)))
    assert bm.match_prefix(keyed_request("b", prompt, (ExtraKey(5, 11, "image-2"),))) == 4
    assert bm.match_prefix(keyed_request("c", prompt, (ExtraKey(5, 11, "image-1"),))) == 20
    bm.check_invariants()


def test_extra_keys_reach_the_pages_commit_hashes() -> None:
    """Pages filled by decode steps hash with the keys too, so a follow-up with the same key matches them."""
    bm = manager(num_pages=16, page_size=4)
    key = (ExtraKey(0, 1, "salt"),)
    a = keyed_request("a", list(range(10, 16)), key)
    compute_all(bm, a)
    for token in (40, 41, 42):
        a.output_ids.append(token)
        assert bm.allocate(a, 1) is not None
        a.num_computed_tokens += 1
        bm.commit(a)
    follow_up = [*a.all_token_ids, 50]
    assert bm.match_prefix(keyed_request("b", follow_up, ())) == 0
    assert bm.match_prefix(keyed_request("c", follow_up, key)) == 8


def test_an_extra_key_range_must_be_non_empty() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        ExtraKey(3, 3, "x")


_keys = st.lists(st.tuples(st.integers(0, 23), st.integers(1, 8), st.sampled_from("abc")), max_size=3).map(
    lambda ks: tuple(ExtraKey(start, start + length, key) for start, length, key in ks)
)


@given(
    page_size=st.sampled_from([1, 2, 4]),
    prompt=st.lists(st.integers(0, 2), min_size=1, max_size=24),
    other_prompt=st.lists(st.integers(0, 2), min_size=1, max_size=24),
    keys=_keys,
    other_keys=_keys,
)
@settings(max_examples=200, deadline=None)
def test_pages_are_shared_exactly_when_tokens_and_keys_agree_up_to_them(
    page_size: int,
    prompt: list[int],
    other_prompt: list[int],
    keys: tuple[ExtraKey, ...],
    other_keys: tuple[ExtraKey, ...],
) -> None:
    """Page i of the second request is a hit iff every page up to i holds the same tokens and is covered by the
    same keys in both requests (never a page computed under another adapter or image)."""
    bm = manager(num_pages=64, page_size=page_size)
    compute_all(bm, keyed_request("a", prompt, keys))

    def covering(extra: tuple[ExtraKey, ...], page: int) -> list[object]:
        start, end = page * page_size, (page + 1) * page_size
        return [k.key for k in extra if k.start < end and k.end > start]

    expected = 0
    for page in range(min(len(prompt) // page_size, (len(other_prompt) - 1) // page_size)):
        start, end = page * page_size, (page + 1) * page_size
        if prompt[start:end] != other_prompt[start:end] or covering(keys, page) != covering(other_keys, page):
            break
        expected = page + 1
    assert bm.match_prefix(keyed_request("b", other_prompt, other_keys)) == expected * page_size
    bm.check_invariants()
