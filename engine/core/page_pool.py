"""Paged KV-cache bookkeeping: which physical page holds which tokens of which sequence.

Pure Python (no torch): the runner turns page tables into index tensors, this module only hands out page ids.

Every page is in exactly one of three states:

- free: holds nothing worth keeping;
- referenced: listed in at least one page table (`refcount > 0`); full pages may be shared by several tables;
- cached-free: no table lists it, but its content is registered in the prefix cache, so a later request with the
  same prefix takes it back instead of recomputing it. When no free page is left, cached-free pages are evicted
  least recently released first.

A full page is identified by a hash chain: `hash((parent_hash, page_token_ids))`, so equal hashes mean equal
tokens at equal positions, the whole prefix included, which is what a page's keys and values depend on. The
chain uses Python's 64-bit tuple hash: computed once per page, when it fills, and cheap enough to run on every
decode step; a collision between two different live prefixes (about n²/2⁶⁴ for n cached pages) is accepted, as
nano-vllm and early vLLM do.

K/V depend on more than token ids when a request says so (`Request.extra_keys`: an adapter, an image's hash, a
cache salt, each over a token range): a page's hash then takes the keys of every range that overlaps the page,
`hash((parent_hash, page_token_ids, keys))`, and through the chain so does every page after it. One mechanism
for all of them: a key for the whole request covers its first token, an image's the tokens it was expanded to.
A page no key covers hashes as it does without any, so requests without extra keys hash as before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field

from engine.core.request import ExtraKey, Request


def _chain_hash(parent: int | None, tokens: tuple[int, ...], keys: tuple[Hashable, ...] = ()) -> int:
    """Identity of a full page: its tokens, the extra keys that cover it and, through `parent`, everything before."""
    return hash((parent, tokens, keys)) if keys else hash((parent, tokens))


def _page_keys(extra_keys: tuple[ExtraKey, ...], start: int, end: int) -> tuple[Hashable, ...]:
    """The keys of the ranges overlapping tokens `[start, end)`, in the request's order."""
    return tuple(extra.key for extra in extra_keys if extra.start < end and extra.end > start)


def _page_hashes(
    tokens: list[int], page_size: int, num_pages: int, extra_keys: tuple[ExtraKey, ...] = ()
) -> Iterator[int]:
    """The hash chain of the first `num_pages` full pages of `tokens`, lazily: callers may stop early."""
    parent: int | None = None
    for start in range(0, num_pages * page_size, page_size):
        end = start + page_size
        keys = _page_keys(extra_keys, start, end) if extra_keys else ()
        parent = _chain_hash(parent, tuple(tokens[start:end]), keys)
        yield parent


def _token_range(request: Request, start: int, end: int) -> tuple[int, ...]:
    """`request.all_token_ids[start:end]` without building the whole list (commit runs on every decode step)."""
    prompt = request.prompt_ids
    split = len(prompt)
    if end <= split:
        return tuple(prompt[start:end])
    if start >= split:
        return tuple(request.output_ids[start - split : end - split])
    return (*prompt[start:], *request.output_ids[: end - split])


@dataclass(slots=True)
class _Sequence:
    """Per-request page state."""

    table: list[int] = field(default_factory=list)
    """Page ids by position; -1 where the sliding window let a page go."""
    hashes: list[int] = field(default_factory=list)
    """Hash chain of the sequence's full pages, by position; may run ahead of `num_registered`."""
    num_registered: int = 0
    """Leading full pages already offered to the prefix cache."""
    num_released: int = 0
    """Leading pages released because they fell out of the sliding window."""
    pending_stats: tuple[int, int] | None = None
    """(queries, hits) of a first admission, counted once its allocate() succeeds (see match_prefix)."""
    num_in_flight_end: int = 0
    """hashes[num_registered:num_in_flight_end] are prompt pages this sequence is computing (see prefix_in_flight)."""


class PagePool:
    """Page pool, per-request page tables, prefix cache with reference counts and LRU eviction."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
        debug_checks: bool = False,
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.debug_checks = debug_checks
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._refcount = [0] * num_pages
        self._page_hash: list[int | None] = [None] * num_pages
        self._hash_to_page: dict[int, int] = {}
        # A stack: pop() is O(1); reversed so that a fresh manager hands out page 0 first (readable tables).
        self._free = list(range(num_pages - 1, -1, -1))
        # Insertion order is release order, so popitem(last=False) evicts the least recently released page.
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._seqs: dict[str, _Sequence] = {}
        # Hashes of prompt pages some sequence is computing right now (count of such sequences).
        self._in_flight: dict[int, int] = {}

    # -- queries -----------------------------------------------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation may take now: free ones plus cached-free ones (evicted on demand)."""
        return len(self._free) + len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of pages referenced by some page table (cached-free pages count as unused)."""
        return 1.0 - self.num_free_pages / self.num_pages

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def page_table(self, request_id: str) -> list[int]:
        """The request's page ids in position order (-1: released by the sliding window); [] when it holds none.

        This is the live list, not a copy (the runner reads every table every step): do not mutate it.
        """
        seq = self._seqs.get(request_id)
        return seq.table if seq is not None else []

    def prefix_in_flight(self, request: Request) -> bool:
        """True when the first prompt page this request would have to compute is being computed by another one.

        Admitting it a step or two later, once that page is committed, shares the pages instead of computing the
        same prefix twice: `n` choices of one prompt, or concurrent requests with one system prompt.
        """
        if not self.enable_prefix_caching or not self._in_flight:
            return False
        tokens = request.all_token_ids
        for h in _page_hashes(tokens, self.page_size, self._matchable_pages(len(tokens)), request.extra_keys):
            if h not in self._hash_to_page:
                return h in self._in_flight
        return False

    # -- mutations -----------------------------------------------------------------------------------------------

    def cached_prefix_tokens(self, request: Request, max_tokens: int | None = None) -> int:
        """How many leading tokens `match_prefix(request, max_tokens)` would find cached now; takes nothing."""
        if not self.enable_prefix_caching:
            return 0
        tokens = request.all_token_ids
        matchable = self._matchable_pages(len(tokens), max_tokens)
        hashes = list(_page_hashes(tokens, self.page_size, matchable, request.extra_keys))
        return self._hit_pages(hashes) * self.page_size

    def can_allocate(self, request: Request, num_new_tokens: int, keep_free: int = 0) -> bool:
        """Whether `allocate(request, num_new_tokens, keep_free)` would succeed now."""
        needed = self.pages_needed(request.num_computed_tokens + num_new_tokens) - len(
            self.page_table(request.request_id)
        )
        return needed <= self.num_free_pages - keep_free

    def match_prefix(self, request: Request, max_tokens: int | None = None) -> int:
        """Take references on the cached full pages that start the request; return how many tokens they hold.

        Call it on a request holding no pages, before its first allocate(). The page holding the last token is
        never matched, so at least one token is left to compute and the model produces logits for it.
        `max_tokens` (a multiple of page_size) caps the match: the page pools of a hybrid model must agree on
        one prefix (see `KVCacheGroups`).

        Counters: a first admission (`request.num_preemptions == 0`) adds its tokens to `prefix_queries` and the
        hit to `prefix_hits`, but only once its allocate() succeeds. A scheduler that cannot admit the request
        frees it and retries later, and that retry must not count the same request twice. A resume after
        preemption re-matches (its own pages are likely still cached) but is not counted again.
        """
        if not self.enable_prefix_caching:
            return 0
        if self.page_table(request.request_id):
            raise ValueError(f"request {request.request_id!r} already holds pages")
        seq = self._seqs[request.request_id] = _Sequence()
        tokens = request.all_token_ids
        ps = self.page_size
        # Hash every full page now; commit() registers them as they get computed instead of hashing again.
        seq.hashes.extend(_page_hashes(tokens, ps, len(tokens) // ps, request.extra_keys))
        hit_pages = self._hit_pages(seq.hashes[: self._matchable_pages(len(tokens), max_tokens)])
        hit = hit_pages * ps
        # Pages already out of the window of every token still to compute are never read: skip them.
        released = self._num_outside_window(hit)
        seq.table = [-1] * released
        for h in seq.hashes[released:hit_pages]:
            page = self._hash_to_page[h]
            self._ref(page)
            seq.table.append(page)
        seq.num_registered = hit_pages
        seq.num_released = released
        seq.num_in_flight_end = len(seq.hashes)
        for h in seq.hashes[hit_pages:]:
            self._in_flight[h] = self._in_flight.get(h, 0) + 1
        if request.num_preemptions == 0:
            seq.pending_stats = (len(tokens), hit)
        self._check()
        return hit

    def allocate(self, request: Request, num_new_tokens: int, keep_free: int = 0) -> list[int] | None:
        """Grow the table to hold `num_computed_tokens + num_new_tokens` tokens; all or nothing.

        Returns the pages appended (often none: the last page still has room), or None, changing nothing, when
        taking them would leave fewer than `keep_free` pages free (cached-free ones count as free).
        """
        seq = self._seqs.get(request.request_id)
        have = len(seq.table) if seq is not None else 0
        needed = -(-(request.num_computed_tokens + num_new_tokens) // self.page_size) - have
        # Hot path (every running request, every step): the last page still has room.
        if needed <= 0 and seq is not None and seq.pending_stats is None:
            return []
        if needed > self.num_free_pages - keep_free:
            return None
        if seq is None:
            seq = self._seqs[request.request_id] = _Sequence()
        new_pages = [self._take_page() for _ in range(needed)]
        seq.table += new_pages
        if seq.pending_stats is not None:
            queries, hits = seq.pending_stats
            self.prefix_queries += queries
            self.prefix_hits += hits
            seq.pending_stats = None
        self._check()
        return new_pages

    def commit(self, request: Request) -> None:
        """Record progress after `request.num_computed_tokens` advanced.

        Registers every page that became full in the prefix cache, and releases pages that fell entirely out of
        the sliding window. A page whose hash is already registered (another request computed the same prefix
        in parallel) stays unregistered: the cache keeps one page per hash and this one becomes free on release.
        """
        seq = self._seqs[request.request_id]
        computed = request.num_computed_tokens
        ps = self.page_size
        # Hot path (every running request, every step): most steps fill no page and release none.
        if self.sliding_window is None and (not self.enable_prefix_caching or computed // ps <= seq.num_registered):
            return
        if computed > len(seq.table) * ps:
            raise ValueError(
                f"request {request.request_id!r} computed {computed} tokens but holds {len(seq.table)} pages"
            )
        if self.enable_prefix_caching:
            num_full = computed // ps
            for i in range(seq.num_registered, num_full):
                if i < seq.num_in_flight_end:
                    self._land(seq.hashes[i])
                if i == len(seq.hashes):
                    parent = seq.hashes[-1] if seq.hashes else None
                    start, end = i * ps, (i + 1) * ps
                    keys = _page_keys(request.extra_keys, start, end) if request.extra_keys else ()
                    seq.hashes.append(_chain_hash(parent, _token_range(request, start, end), keys))
                h = seq.hashes[i]
                if h not in self._hash_to_page:
                    page = seq.table[i]
                    self._page_hash[page] = h
                    self._hash_to_page[h] = page
            seq.num_registered = max(seq.num_registered, num_full)
        release_to = self._num_outside_window(computed)
        for i in range(seq.num_released, release_to):
            self._unref(seq.table[i])
            seq.table[i] = -1
        seq.num_released = max(seq.num_released, release_to)
        self._check()

    def shrink(self, request: Request, num_tokens: int) -> bool:
        """Give back the request's trailing pages beyond those `num_tokens` tokens need (slots written for
        rejected drafts); True when any went. Only pages past `num_computed_tokens` can go, and those were never
        registered in the prefix cache (commit registers computed pages only), so they return to the free list."""
        if num_tokens < request.num_computed_tokens:
            raise ValueError(f"cannot shrink request {request.request_id!r} below its computed tokens")
        seq = self._seqs[request.request_id]
        keep = max(self.pages_needed(num_tokens), seq.num_released)
        if len(seq.table) <= keep:
            return False
        for page in reversed(seq.table[keep:]):
            self._unref(page)
        del seq.table[keep:]
        self._check()
        return True

    def free(self, request_id: str) -> None:
        """Drop the request's table; idempotent. Hashed pages nobody else uses become cached-free.

        Pages are released last to first, so a sequence's tail (least likely to be shared) is evicted before
        its head (a system prompt, say).
        """
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        for h in seq.hashes[seq.num_registered : seq.num_in_flight_end]:
            self._land(h)
        for page in reversed(seq.table):
            if page != -1:
                self._unref(page)
        self._check()

    # -- internals -------------------------------------------------------------------------------------------------

    def _matchable_pages(self, num_tokens: int, max_tokens: int | None = None) -> int:
        """Full pages a prefix match may cover: never the last token's page, whose logits must be computed."""
        pages = (num_tokens - 1) // self.page_size
        return pages if max_tokens is None else min(pages, max_tokens // self.page_size)

    def _hit_pages(self, hashes: list[int]) -> int:
        """Length in pages of the longest prefix of `hashes` whose pages a continuation would read.

        Full attention reads every page, so that is the run of cached pages from the start. A sliding window
        reads only the pages inside it: earlier pages may have been evicted and the prefix still counts.
        """
        hit = 0
        run_start = 0  # first page of the run of cached pages ending at the current one
        for i, h in enumerate(hashes):
            if h not in self._hash_to_page:
                run_start = i + 1
            elif run_start <= self._num_outside_window((i + 1) * self.page_size):
                hit = i + 1
        return hit

    def _num_outside_window(self, num_computed: int) -> int:
        """Leading pages ending before `num_computed - sliding_window`: no token still to compute attends to them.

        Positions from `num_computed` on attend at most `sliding_window` tokens back, so a page lying entirely
        before `num_computed - sliding_window` is never read again, whether the window bound is inclusive or not.
        """
        if self.sliding_window is None:
            return 0
        return max(0, num_computed - self.sliding_window) // self.page_size

    def _land(self, page_hash: int) -> None:
        count = self._in_flight[page_hash] - 1
        if count:
            self._in_flight[page_hash] = count
        else:
            del self._in_flight[page_hash]

    def _take_page(self) -> int:
        if self._free:
            page = self._free.pop()
        else:
            page, _ = self._cached.popitem(last=False)
            # Its content is about to be overwritten: the prefix cache must stop pointing at it.
            del self._hash_to_page[self._page_hash[page]]
            self._page_hash[page] = None
        self._refcount[page] = 1
        return page

    def _ref(self, page: int) -> None:
        if self._refcount[page] == 0:
            del self._cached[page]
        self._refcount[page] += 1

    def _unref(self, page: int) -> None:
        count = self._refcount[page] - 1
        if count < 0:
            raise AssertionError(f"page {page} released more often than referenced")
        self._refcount[page] = count
        if count == 0:
            if self._page_hash[page] is None:
                self._free.append(page)
            else:
                self._cached[page] = None

    def _check(self) -> None:
        if self.debug_checks:
            self.check_invariants()

    def check_invariants(self) -> None:
        """Raise AssertionError unless free + cached-free + referenced == num_pages and all counts agree.

        O(num_pages + total table length): for tests and debug_checks, not for the hot path.
        """
        expected = [0] * self.num_pages
        for seq in self._seqs.values():
            for page in seq.table:
                if page != -1:
                    expected[page] += 1
        problems: list[str] = []
        if expected != self._refcount:
            bad = [p for p in range(self.num_pages) if expected[p] != self._refcount[p]]
            problems.append(f"refcounts disagree with page tables on pages {bad[:10]}")
        if len(set(self._free)) != len(self._free):
            problems.append("a page is on the free list twice")
        if any(self._refcount[p] or self._page_hash[p] is not None for p in self._free):
            problems.append("a free page is referenced or hashed")
        for page in self._cached:
            h = self._page_hash[page]
            if self._refcount[page] or h is None or self._hash_to_page.get(h) != page:
                problems.append(f"cached-free page {page} is referenced or not registered")
        in_flight: dict[int, int] = {}
        for seq in self._seqs.values():
            for h in seq.hashes[seq.num_registered : seq.num_in_flight_end]:
                in_flight[h] = in_flight.get(h, 0) + 1
        if in_flight != self._in_flight:
            problems.append("in-flight prefix hashes disagree with the sequences computing them")
        referenced = sum(1 for count in self._refcount if count > 0)
        if len(self._free) + len(self._cached) + referenced != self.num_pages:
            problems.append(
                f"free {len(self._free)} + cached {len(self._cached)} + referenced {referenced} "
                f"!= {self.num_pages} pages"
            )
        if any(self._page_hash[p] != h for h, p in self._hash_to_page.items()):
            problems.append("prefix-cache index and page hashes disagree")
        if sum(h is not None for h in self._page_hash) != len(self._hash_to_page):
            problems.append("a hashed page is missing from the prefix-cache index")
        if problems:
            raise AssertionError("; ".join(problems))
