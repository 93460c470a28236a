"""Suffix decoding (`method: suffix`; SuffixDecoding, arXiv 2411.04975): drafts from counted suffix tries over
each request's own tokens and over the outputs of recently finished requests.

Agent loops and code edits repeat themselves: within a request (quoting the prompt, re-emitting a block) and
across requests (the same tool call or plan, step after step). A trie of every substring of up to
`max_tree_depth` tokens, with how often each occurred, finds the recent context that was seen before and the
continuation it most often had; the counts estimate how likely that continuation is, so a draft stops where a
guess is no longer worth verifying.

The data, all pure Python:

- `_Node`: a substring that occurred at least twice (or, in the cache after an eviction, once): `count` (its
  occurrences), `continued` (those followed by a token: the sum of its children's counts), `children` (next token
  -> `_Node` | `_Tail`), `best_token` (the child with the highest count, kept as counts change, with a bound on
  its `lead`) and `link` (the node of the same string less its first token: its suffixes are nodes too, having
  occurred at least as often).
- `_Tail`: the rest of a substring that occurred once, `tokens[position:min(limit, len(tokens))]` of the sequence
  it occurred in. Past a few tokens most substrings of new text occur once; one object for such a branch instead
  of a chain of nodes keeps a trie at O(length) objects for new text (repeated text can cost up to O(length ×
  depth) nodes, as in any suffix trie cut at a depth), and a tail of a growing sequence grows with it for free.
- `_SuffixTrie`: a root `_Node` and the depth bound: every suffix of every sequence added, cut at `max_depth`.
- Per running request, `_RequestState`: its tokens (prompt + output so far), its own trie, `matched` (the nodes
  of its last 1, 2, … tokens that occurred earlier in it, shortest first: what the next token extends; every
  length up to the longest, since a string's suffixes occur wherever it does) and `cache_match` (a `_CacheMatch`:
  where its last tokens are in the cache, followed along suffix links).
- `SuffixDrafts`: the running requests' states, and the cache: one trie over the outputs of the last
  `max_cached_requests` finished requests, kept in a deque, oldest first, to be taken back out of the trie.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence

from engine.speculative.source import DraftingRequest

ROUNDING_SLACK = 1e-6
"""Added to `max_spec_factor` × match length before rounding down, so that a float product meant to be whole
(0.29 × 100 = 28.999999999999996) still allows that many drafts."""


class _Tail:
    """The rest of a substring that occurred once: `tokens[position:end]`, `end` being `limit` (the depth bound
    counted from where the occurrence began) or the sequence's end, whichever comes first. As a child it is keyed
    by its first token; as a place in a trie (a match) it holds the tokens still to come."""

    __slots__ = ("limit", "position", "tokens")

    count = 1
    """Occurrences of each of its strings: one. A class constant, so that every child has a `count`."""

    def __init__(self, tokens: list[int], position: int, limit: int) -> None:
        self.tokens = tokens
        self.position = position
        self.limit = limit

    @property
    def end(self) -> int:
        return min(self.limit, len(self.tokens))

    def after_first(self) -> _Tail:
        """The same occurrence, one token further."""
        return _Tail(self.tokens, self.position + 1, self.limit)


class _Node:
    """A substring of some sequence in a trie, with its counts (see the module docstring)."""

    __slots__ = ("best_token", "children", "continued", "count", "lead", "link")

    def __init__(self, count: int, link: _Node | None = None) -> None:
        self.count = count
        self.link = self if link is None else link
        """The node of this string less its first token (the root's is itself): where a match falls back to
        the next shorter context, as a failure link does in Aho-Corasick."""
        self.continued = 0
        self.children: dict[int, _Node | _Tail] = {}
        self.best_token: int | None = None
        """The child with the highest count, the latest to grow winning ties (recent text is the better guess).
        None with no children, or once evictions used up its `lead`: `most_frequent` looks again then."""
        self.lead = 0
        """At most how many occurrences the best child has over every other: while it lasts, an eviction that
        lowers the best child leaves it the best, so that the nodes an evicted output passes through (every
        common token's, with hundreds of children) need no new look at their children."""

    def child_grew(self, token: int, child: _Node | _Tail) -> None:
        """Keep `best_token` and `lead` after `child` (under `token`) gained an occurrence."""
        best = self.best_token
        if best is None:
            if len(self.children) == 1:
                self.best_token, self.lead = token, child.count
        elif best == token:
            self.lead += 1
        else:
            margin = self.children[best].count - child.count
            if margin <= 0:
                self.best_token, self.lead = token, -margin
            elif margin < self.lead:
                self.lead = margin

    def child_shrank(self, token: int) -> None:
        """The child under `token` lost an occurrence (if it was its last, it is gone already): the best one
        stays the best while its lead lasts; else which one is the best is looked up when a draft needs it."""
        if token == self.best_token:
            self.lead -= 1
            if self.lead < 0 or token not in self.children:
                self.best_token = None

    def most_frequent(self) -> int | None:
        """The token of the child with the highest count; None without children. Looked for again after
        evictions, it does not know which grew last: ties then go to the latest child added."""
        if self.best_token is None and self.children:
            best_count = runner_up_count = 0
            for token, child in self.children.items():
                if child.count >= best_count:
                    self.best_token, best_count, runner_up_count = token, child.count, best_count
                elif child.count > runner_up_count:
                    runner_up_count = child.count
            self.lead = best_count - runner_up_count
        return self.best_token


def _split(tail: _Tail, link: _Node) -> _Node:
    """The node for a tail's first token, now that a second occurrence reached it; the first occurrence's rest
    hangs below it as a shorter tail. That rest is never empty while its sequence grows: the second occurrence
    starts later in it, so the first one has a token after this one (unless the depth bound ends it)."""
    node = _Node(count=2, link=link)
    rest = tail.after_first()
    if rest.position < rest.end:
        next_token = rest.tokens[rest.position]
        node.children[next_token] = rest
        node.continued = 1
        node.child_grew(next_token, rest)
    return node


class _SuffixTrie:
    """Every suffix of the sequences added, cut at `max_depth` tokens, with counts (see the module docstring)."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node(count=0)

    def count_token(self, tokens: list[int], position: int, matched: list[_Node]) -> list[_Node]:
        """Count `tokens[position]` as the last token of every suffix of up to `max_depth` tokens ending there,
        given `matched`, the nodes of the suffixes ending just before it that occurred before (shortest first);
        returns the same for the suffixes ending at it. A suffix seen for the first time ends in a new tail, which
        grows with `tokens` with no further work: only text seen before costs a step per suffix."""
        token = tokens[position]
        extended: list[_Node] = []
        shorter = self.root  # the node of the current suffix less its first token, the previous one's
        for length, node in enumerate([self.root, *matched]):
            node.continued += 1
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Tail(tokens, position, position - length + self.max_depth)
            elif isinstance(child, _Tail):
                child = node.children[token] = _split(child, link=shorter)
            else:
                child.count += 1
            node.child_grew(token, child)
            if isinstance(child, _Node):
                shorter = child
                if length + 1 < self.max_depth:
                    extended.append(child)
        return extended

    def add(self, tokens: list[int]) -> None:
        """Count every suffix of `tokens` (kept, not copied: tails read it)."""
        matched: list[_Node] = []
        for position in range(len(tokens)):
            matched = self.count_token(tokens, position, matched)

    def remove(self, tokens: list[int]) -> None:
        """Take back what `add(tokens)` counted: each suffix's path loses one occurrence, and a branch left with
        none is cut off (the suffix's own tail, or a node whose only occurrence it was, with all below it)."""
        for start in range(len(tokens)):
            node = self.root
            for position in range(start, min(start + self.max_depth, len(tokens))):
                token = tokens[position]
                node.continued -= 1
                child = node.children[token]
                if isinstance(child, _Tail) or child.count == 1:
                    del node.children[token]
                    node.child_shrank(token)
                    break
                child.count -= 1
                node.child_shrank(token)
                node = child


class _CacheMatch:
    """Where a running request's latest tokens are in the cache's trie, followed token by token.

    The suffixes of its tokens found there are every length from 1 to `length`. The shorter ones are nodes: the
    longest is `node` (`node_length` tokens), the others its suffix links. Any longer ones occurred once, so they
    all lie in one occurrence, and all end just before `tail_tokens[tail_position]` (None when there are none). So
    one token moves the match in O(1) amortized, as Aho-Corasick moves along failure links: the node part grows
    by at most one per token and each link followed shortens it; and it is found again in O(depth) from the
    request's last `max_depth` tokens.
    """

    __slots__ = ("length", "node", "node_length", "tail_position", "tail_tokens", "trie")

    def __init__(self, trie: _SuffixTrie, tokens: Sequence[int]) -> None:
        self.trie = trie
        self.node = trie.root
        self.node_length = 0
        self.tail_tokens: list[int] | None = None
        self.tail_position = 0
        self.length = 0
        for token in tokens[-trie.max_depth :]:
            self.advance(token)

    def advance(self, token: int) -> None:
        # The longest node whose string followed by `token` is in the trie: the longest match now, unless the
        # tail's occurrence goes on with `token`.
        node, length = self.node, self.node_length
        child = node.children.get(token)
        while child is None and length > 0:
            node, length = node.link, length - 1
            child = node.children.get(token)
        tail = self.tail_tokens
        if tail is not None and self.tail_position < len(tail) and tail[self.tail_position] == token:
            self.tail_position += 1
            self.length = min(self.length + 1, self.trie.max_depth)
        elif isinstance(child, _Tail):
            self.tail_tokens, self.tail_position = child.tokens, child.position + 1
            self.length = length + 1
        else:
            self.tail_tokens = None
            self.length = 0 if child is None else length + 1
        # The longest that is a node: a suffix of a string that occurred once may have occurred more often.
        while isinstance(child, _Tail):
            if length == 0:
                child = None
                break
            node, length = node.link, length - 1
            child = node.children[token]
        if child is None:
            self.node, self.node_length = self.trie.root, 0
        else:
            self.node, self.node_length = child, length + 1
        if self.length <= self.node_length:
            self.tail_tokens = None

    def candidates(self) -> Iterator[tuple[int, _Node | _Tail]]:
        """Each suffix found, longest first: (its length, where it is)."""
        if self.tail_tokens is not None:
            for length in range(self.length, self.node_length, -1):
                start = self.tail_position - length
                yield length, _Tail(self.tail_tokens, self.tail_position, start + self.trie.max_depth)
        node = self.node
        for length in range(self.node_length, 0, -1):
            yield length, node
            node = node.link


def _draft(location: _Node | _Tail, max_tokens: int, min_token_prob: float) -> tuple[list[int], float]:
    """The greedy continuation of `location`'s string: the most frequent next token, while the probability of
    the whole path (the product of count(child) / continued(parent) along it) is at least `min_token_prob`; and
    its score, the sum of those probabilities: the expected number of drafts accepted, if counts are odds."""
    drafted: list[int] = []
    score = 0.0
    probability = 1.0
    while len(drafted) < max_tokens:
        if isinstance(location, _Tail):
            # One occurrence from here on: each of its tokens follows the one before with probability 1.
            end = min(location.end, location.position + max_tokens - len(drafted))
            drafted += location.tokens[location.position : end]
            score += probability * (end - location.position)
            break
        token = location.most_frequent()
        if token is None:
            break
        child = location.children[token]
        probability *= child.count / location.continued
        if probability < min_token_prob:
            break
        if isinstance(child, _Node):
            drafted.append(token)
            score += probability
        location = child  # a tail drafts its first token (this one) with the rest
    return drafted, score


class _RequestState:
    """What is kept of one running request (see the module docstring)."""

    __slots__ = ("cache_match", "cache_version", "matched", "num_prompt", "tokens", "trie")

    def __init__(self, prompt_ids: Sequence[int], max_depth: int, cache: _SuffixTrie, cache_version: int) -> None:
        self.tokens: list[int] = []
        self.num_prompt = len(prompt_ids)
        self.trie = _SuffixTrie(max_depth)
        self.matched: list[_Node] = []
        self.extend(prompt_ids)
        self.cache_match = _CacheMatch(cache, self.tokens)
        self.cache_version = cache_version
        """The cache's version `cache_match` was found in: when it changed, it is found again."""

    def extend(self, new_tokens: Sequence[int]) -> None:
        for token in new_tokens:
            self.tokens.append(token)
            self.matched = self.trie.count_token(self.tokens, len(self.tokens) - 1, self.matched)


class SuffixDrafts:
    """`DraftSource` by suffix decoding.

    Each step, for each request: count its new tokens into its own trie (O(new tokens × suffixes of up to
    `max_tree_depth` seen before)), and follow them in the cache's trie along suffix links (O(new tokens)
    amortized; found again from its last `max_tree_depth` tokens when a request finished since). Then, for each
    context length matched, longest first, in either trie, the greedy continuation by counts (`_draft`), at most
    `max_spec_factor` × match length + `max_spec_offset` tokens and stopping where the path's probability falls
    below `min_token_prob`. The highest-scoring draft wins (ties: the longer match, then the request's own trie);
    shorter matches are skipped once their cap cannot beat it. A finished request's output joins the cache, whose
    oldest output is taken back out past `max_cached_requests`.
    """

    def __init__(
        self,
        max_tree_depth: int = 24,
        max_cached_requests: int = 1000,
        min_token_prob: float = 0.1,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
    ) -> None:
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.min_token_prob = min_token_prob
        self.max_spec_factor = max_spec_factor
        self.max_spec_offset = max_spec_offset
        self._requests: dict[str, _RequestState] = {}
        self._cache = _SuffixTrie(max_tree_depth)
        self._cached_outputs: deque[list[int]] = deque()
        """The outputs counted in `_cache`, oldest first."""
        self._cache_version = 0
        """Changes whenever `_cache` does."""

    def propose(self, request: DraftingRequest, max_drafts: int) -> list[int]:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestState(
                request.prompt_ids, self.max_tree_depth, self._cache, self._cache_version
            )
        new_tokens = request.output_ids[len(state.tokens) - state.num_prompt :]
        state.extend(new_tokens)
        if state.cache_version == self._cache_version:
            for token in new_tokens:
                state.cache_match.advance(token)
        else:
            state.cache_match = _CacheMatch(self._cache, state.tokens)
            state.cache_version = self._cache_version
        matched = state.matched
        own = self._better_draft(((i + 1, matched[i]) for i in range(len(matched) - 1, -1, -1)), max_drafts, ([], 0.0))
        return self._better_draft(state.cache_match.candidates(), max_drafts, own)[0]

    def finished(self, request: DraftingRequest) -> None:
        self._requests.pop(request.request_id, None)
        if self.max_cached_requests <= 0 or not request.output_ids:
            return
        output = list(request.output_ids)
        self._cache.add(output)
        self._cached_outputs.append(output)
        if len(self._cached_outputs) > self.max_cached_requests:
            self._cache.remove(self._cached_outputs.popleft())
        self._cache_version += 1

    def _better_draft(
        self,
        matches: Iterable[tuple[int, _Node | _Tail]],
        max_drafts: int,
        incumbent: tuple[list[int], float],
    ) -> tuple[list[int], float]:
        """The highest-scoring draft from `matches` ((length, where), longest first) if it scores above
        `incumbent`'s, else `incumbent`. A shorter match's cap is no higher, so the search ends at the first whose
        cap cannot beat the best score so far (a draft scores at most its length)."""
        best_drafted, best_score = incumbent
        for length, location in matches:
            cap = min(max_drafts, int(length * self.max_spec_factor + self.max_spec_offset + ROUNDING_SLACK))
            if cap <= best_score:
                break
            drafted, score = _draft(location, cap, self.min_token_prob)
            if score > best_score:
                best_drafted, best_score = drafted, score
        return best_drafted, best_score
