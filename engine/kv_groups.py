"""One page pool per kind of attention layer: what lets a hybrid model's sliding-window layers forget old pages.

A page holds the K/V of its tokens for the layers of one group. When every layer shares one window (Mistral) or
none has one (Llama), there is one group and this is a thin wrapper over a single `BlockManager`. A hybrid model
(full-attention layers next to sliding-window ones: Qwen2 with `layer_types`, Gemma-style stacks) gets one pool
per distinct window, each with its own block tables: the full layers keep every page, the sliding layers release
pages that fell out of their window and so need only a small pool (vLLM's hybrid KV cache groups).

Pure Python, like `BlockManager`. The first group (full attention when the model has any) is the primary one:
it bounds admission and its counters are the engine's cache statistics. The other pools are sized so that they
can hold every running sequence's window (`sliding_pool_pages`); should one still run short, `allocate` fails as
a full primary pool does, and the scheduler preempts.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache import BlockManager
from engine.request import Request


@dataclass(frozen=True)
class GroupLayout:
    """Which layers share a page pool: those with the same sliding window (None: full attention)."""

    window: int | None
    layers: tuple[int, ...]


def group_layers(windows: list[int | None]) -> list[GroupLayout]:
    """Layers grouped by window, the primary group first: full attention if any layer has it, else the widest."""
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_window.setdefault(window, []).append(layer)
    order = sorted(by_window, key=lambda w: (w is not None, -(w or 0)))
    return [GroupLayout(w, tuple(by_window[w])) for w in order]


def sliding_pool_pages(window: int, page_size: int, max_num_seqs: int, max_batch_tokens: int) -> int:
    """Pages a sliding group needs when every running sequence holds what it may: its window, plus this step.

    Between steps a sequence holds the pages of its last `window` tokens (at most ceil(window / page_size) + 1
    pages, the first one partly outside); a step adds pages for its new tokens, at most `max_batch_tokens` in all
    plus one partly filled page per sequence.
    """
    per_sequence = -(-window // page_size) + 2
    return max_num_seqs * per_sequence + -(-max_batch_tokens // page_size)


class KVCacheGroups:
    """The `BlockManager` interface the scheduler uses, over one pool per group; block tables per group."""

    def __init__(self, layouts: list[GroupLayout], managers: list[BlockManager]) -> None:
        if len(layouts) != len(managers) or not managers:
            raise ValueError("one BlockManager per group layout, at least one")
        self.layouts = layouts
        self.managers = managers
        self.primary = managers[0]
        if len(managers) == 1:
            # One pool (most models): the calls made for every running request every step go straight to it.
            self.allocate = self.primary.allocate  # type: ignore[method-assign]
            self.commit = self.primary.commit  # type: ignore[method-assign]

    # -- the primary pool's view: admission, limits and statistics --------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.primary.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.primary.num_free_blocks

    @property
    def usage(self) -> float:
        return self.primary.usage

    @property
    def prefix_queries(self) -> int:
        return self.primary.prefix_queries

    @property
    def prefix_hits(self) -> int:
        return self.primary.prefix_hits

    def blocks_needed(self, num_tokens: int) -> int:
        return self.primary.blocks_needed(num_tokens)

    def block_table(self, request_id: str) -> list[int]:
        return self.primary.block_table(request_id)

    def prefix_in_flight(self, request: Request) -> bool:
        # Every pool computes the same tokens in the same step, so the primary pool's answer holds for all.
        return self.primary.prefix_in_flight(request)

    # -- every pool ---------------------------------------------------------------------------------------------

    def block_tables(self, request_ids: list[str]) -> list[list[list[int]]]:
        """Per group, in group order, each request's table (live lists: do not mutate)."""
        return [[m.block_table(request_id) for request_id in request_ids] for m in self.managers]

    def match_prefix(self, request: Request) -> int:
        """The longest prefix every pool holds: a token's K/V must be cached for all layers to be skipped."""
        if len(self.managers) == 1:
            return self.primary.match_prefix(request)
        # A sliding pool's hit lengths need not be every length below its longest (a shorter prefix may need a
        # page it evicted), so shrink until every pool holds exactly the same prefix.
        common = min(m.cached_prefix_tokens(request) for m in self.managers)
        while True:
            agreed = min(m.cached_prefix_tokens(request, max_tokens=common) for m in self.managers)
            if agreed == common:
                break
            common = agreed
        for manager in self.managers:
            if manager.match_prefix(request, max_tokens=common) != common:
                raise AssertionError("a pool matched another prefix than the one all pools agreed on")
        return common

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """All pools or none."""
        if not all(m.can_allocate(request, num_new_tokens) for m in self.managers):
            return False
        for manager in self.managers:
            if not manager.allocate(request, num_new_tokens):
                raise AssertionError("a pool refused pages can_allocate promised")
        return True

    def commit(self, request: Request) -> None:
        for manager in self.managers:
            manager.commit(request)

    def free(self, request_id: str) -> None:
        for manager in self.managers:
            manager.free(request_id)

    def all_free(self) -> bool:
        """Every page of every pool is free or merely cached."""
        return all(m.num_free_blocks == m.num_blocks for m in self.managers)

    def check_invariants(self) -> None:
        for manager in self.managers:
            manager.check_invariants()
