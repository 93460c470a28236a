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
  -> `_Node` | `_Tail`) and `best_token` (the child with the highest count, kept as counts change).
- `_Tail`: the rest of a substring that occurred once, `tokens[position:min(limit, len(tokens))]` of the sequence
  it occurred in. Past a few tokens most substrings of new text occur once; one object for such a branch instead
  of a chain of nodes keeps a trie at O(length) objects for new text (repeated text can cost up to O(length ×
  depth) nodes, as in any suffix trie cut at a depth), and a tail of a growing sequence grows with it for free.
- `_SuffixTrie`: a root `_Node` and the depth bound: every suffix of every sequence added, cut at `max_depth`.
- Per running request, `_RequestState`: its tokens (prompt + output so far), its own trie, `matched` (the nodes
  of its last 1, 2, … tokens that occurred earlier in it: what the next token extends) and `cache_matches`
  (where its last 1, 2, … tokens are in the cache). Both lists are shortest first, entry i for the last i + 1
  tokens, and hold every length up to their longest: a string's suffixes occur wherever it does.
- `SuffixDrafts`: the running requests' states, and the cache: one trie over the outputs of the last
  `max_cached_requests` finished requests, kept in a deque, oldest first, to be taken back out of the trie.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

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

    __slots__ = ("best_token", "children", "continued", "count")

    def __init__(self, count: int) -> None:
        self.count = count
        self.continued = 0
        self.children: dict[int, _Node | _Tail] = {}
        self.best_token: int | None = None
        """The child with the highest count, the latest to grow winning ties (recent text is the better guess).
        None with no children, or after an eviction lowered the best one: `most_frequent` looks again then."""

    def child_grew(self, token: int, child: _Node | _Tail) -> None:
        """Keep `best_token` after `child` (under `token`) gained an occurrence."""
        best = self.best_token
        if best is None:
            if len(self.children) == 1:
                self.best_token = token
        elif best != token and child.count >= self.children[best].count:
            self.best_token = token

    def child_shrank(self, token: int) -> None:
        """The child under `token` lost an occurrence: if it was the best, which one is now is looked up when a
        draft needs it (rarely: this happens for every position of an evicted output, mostly to nodes, like the
        root, that are never drafted from)."""
        if token == self.best_token:
            self.best_token = None

    def most_frequent(self) -> int | None:
        """The token of the child with the highest count; None without children. After an eviction the latest to
        grow is not known: ties then go to the latest child added."""
        if self.best_token is None and self.children:
            best_count = 0
            for token, child in self.children.items():
                if child.count >= best_count:
                    self.best_token, best_count = token, child.count
        return self.best_token


def _split(tail: _Tail) -> _Node:
    """The node for a tail's first token, now that a second occurrence reached it; the first occurrence's rest
    hangs below it as a shorter tail. That rest is never empty while its sequence grows: the second occurrence
    starts later in it, so the first one has a token after this one (unless the depth bound ends it)."""
    node = _Node(count=2)
    rest = tail.after_first()
    if rest.position < rest.end:
        next_token = rest.tokens[rest.position]
        node.children[next_token] = rest
        node.continued = 1
        node.best_token = next_token
    return node


def _step(location: _Node | _Tail, token: int) -> _Node | _Tail | None:
    """Where `location`'s string followed by `token` is in the trie; None when that string is not in it."""
    if isinstance(location, _Tail):
        if location.position < location.end and location.tokens[location.position] == token:
            return location.after_first()
        return None
    child = location.children.get(token)
    return child.after_first() if isinstance(child, _Tail) else child


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
        for length, node in enumerate([self.root, *matched]):
            node.continued += 1
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Tail(tokens, position, position - length + self.max_depth)
            elif isinstance(child, _Tail):
                child = node.children[token] = _split(child)
            else:
                child.count += 1
            node.child_grew(token, child)
            if isinstance(child, _Node) and length + 1 < self.max_depth:
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
                node.child_shrank(token)
                child = node.children[token]
                if isinstance(child, _Tail) or child.count == 1:
                    del node.children[token]
                    break
                child.count -= 1
                node = child

    def advance(self, matches: list[_Node | _Tail], token: int) -> list[_Node | _Tail]:
        """Where the suffixes ending at `token` are, given where those ending just before it are (shortest
        first); once one is not in the trie, no longer one is."""
        advanced: list[_Node | _Tail] = []
        for location in [self.root, *matches]:
            found = _step(location, token)
            if found is None:
                break
            advanced.append(found)
        return advanced

    def match(self, tokens: Sequence[int]) -> list[_Node | _Tail]:
        """Where the suffixes of `tokens` are (shortest first, as many as are in the trie)."""
        matches: list[_Node | _Tail] = []
        for token in tokens:
            matches = self.advance(matches, token)
        return matches


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

    __slots__ = ("cache_matches", "cache_version", "matched", "num_prompt", "tokens", "trie")

    def __init__(self, prompt_ids: Sequence[int], max_depth: int) -> None:
        self.tokens: list[int] = []
        self.num_prompt = len(prompt_ids)
        self.trie = _SuffixTrie(max_depth)
        self.matched: list[_Node] = []
        self.cache_matches: list[_Node | _Tail] = []
        self.cache_version = -1
        """The cache's version `cache_matches` were found in: when it changed they are found again."""
        self.extend(prompt_ids)

    def extend(self, new_tokens: Sequence[int]) -> None:
        for token in new_tokens:
            self.tokens.append(token)
            self.matched = self.trie.count_token(self.tokens, len(self.tokens) - 1, self.matched)


class SuffixDrafts:
    """`DraftSource` by suffix decoding.

    Each step, for each request: count its new tokens into its own trie (O(new tokens × suffixes of up to
    `max_tree_depth` seen before)), and follow them in the cache's trie from where its last tokens were (found
    again from its last `max_tree_depth` tokens when a request finished since: O(depth²) at most). Then, for each
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
            state = self._requests[request.request_id] = _RequestState(request.prompt_ids, self.max_tree_depth)
        new_tokens = request.output_ids[len(state.tokens) - state.num_prompt :]
        state.extend(new_tokens)
        if state.cache_version == self._cache_version:
            for token in new_tokens:
                state.cache_matches = self._cache.advance(state.cache_matches, token)
        else:
            state.cache_matches = self._cache.match(state.tokens[-self.max_tree_depth :])
            state.cache_version = self._cache_version
        own = self._better_draft(state.matched, max_drafts, ([], 0.0))
        return self._better_draft(state.cache_matches, max_drafts, own)[0]

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
        self, matches: Sequence[_Node | _Tail], max_drafts: int, incumbent: tuple[list[int], float]
    ) -> tuple[list[int], float]:
        """The highest-scoring draft from `matches` (entry i: where the last i + 1 tokens are) if it scores above
        `incumbent`'s, else `incumbent`. Longest match first: a shorter one's cap is no higher, so the search ends
        at the first whose cap cannot beat the best score so far (a draft scores at most its length)."""
        best_drafted, best_score = incumbent
        for index in range(len(matches) - 1, -1, -1):
            cap = min(max_drafts, int((index + 1) * self.max_spec_factor + self.max_spec_offset + ROUNDING_SLACK))
            if cap <= best_score:
                break
            drafted, score = _draft(matches[index], cap, self.min_token_prob)
            if score > best_score:
                best_drafted, best_score = drafted, score
        return best_drafted, best_score
