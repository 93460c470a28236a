"""The KV-cache manager the scheduler talks to: one or several page pools behind one small interface.

One page pool per kind of attention layer is what lets a hybrid model's sliding-window layers forget old pages.

A page holds the K/V of its tokens for the layers of one group. When every layer shares one window (Mistral) or
none has one (Llama), there is one group and this is a thin layer over a single `PagePool`. A hybrid model
(full-attention layers next to sliding-window ones: Qwen2 with `layer_types`, Gemma-style stacks) gets one pool
per distinct window, each with its own page tables: the full layers keep every page, the sliding layers release
pages that fell out of their window and so need only a small pool (vLLM's hybrid KV cache groups).

The groups are formed from the layers' cache specs (engine/attention/spec.py, `CausalLM.cache_specs`): layers
whose caches keep the same tokens (one window, or every token) share a pool, and a group's page holds what each of
its layers' specs keeps of a page's tokens, whatever its heads or dtype.

Pure Python, like `PagePool`. The first group (full attention when the model has any) is the primary one:
it bounds admission and its counters are the engine's cache statistics. The other pools are sized so that they
can hold every running sequence's window (`sliding_pool_pages`); should one still run short, `allocate` fails as
a full primary pool does, and the scheduler preempts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.core.page_pool import PagePool
from engine.core.request import Request
from engine.core.state_slots import StateSlots


class PagedLayerSpec(Protocol):
    """What grouping reads of a layer's cache spec (`FullAttentionSpec`, `SlidingWindowSpec`)."""

    @property
    def window(self) -> int | None:
        """The positions a query attends to (None: all): which pages the layer may release."""
        ...

    @property
    def bytes_per_token(self) -> int: ...


@dataclass(frozen=True)
class GroupLayout:
    """Which layers share a page pool: those with the same sliding window (None: full attention)."""

    window: int | None
    layers: tuple[int, ...]
    page_bytes: int
    """What one page of the pool takes, over all the group's layers (each as its spec keeps a token)."""


def group_layers(specs: Sequence[PagedLayerSpec], page_size: int) -> list[GroupLayout]:
    """Layers grouped by their specs' window, the primary group first: full attention if any layer has it, else
    the widest window. Layers of one window share page ids whatever their heads or dtype: their K/V tensors are
    each layer's own, and attention finds a layer's step metadata by its window (engine/attention/context.py)."""
    by_window: dict[int | None, list[int]] = {}
    for layer, spec in enumerate(specs):
        by_window.setdefault(spec.window, []).append(layer)
    order = sorted(by_window, key=lambda w: (w is not None, -(w or 0)))
    return [
        GroupLayout(w, tuple(by_window[w]), page_size * sum(specs[layer].bytes_per_token for layer in by_window[w]))
        for w in order
    ]


def sliding_pool_pages(window: int, page_size: int, max_num_seqs: int, max_batch_tokens: int) -> int:
    """Pages a sliding group needs when every running sequence holds what it may: its window, plus this step.

    Between steps a sequence holds the pages of its last `window` tokens (at most ceil(window / page_size) + 1
    pages, the first one partly outside); a step adds pages for its new tokens, at most `max_batch_tokens` in all
    plus one partly filled page per sequence.
    """
    per_sequence = -(-window // page_size) + 2
    return max_num_seqs * per_sequence + -(-max_batch_tokens // page_size)


def pool_pages(
    layouts: list[GroupLayout],
    *,
    num_pages: int | None,
    budget_bytes: float,
    page_size: int,
    max_num_seqs: int,
    max_batch_tokens: int,
) -> list[int]:
    """Pages of each group's pool: `num_pages` (or what `budget_bytes` allows) for the primary group, and for a
    secondary (sliding) group no more than all running sequences' windows can fill.
    """
    caps = []
    for layout in layouts[1:]:
        assert layout.window is not None, "only the primary group can be full attention"
        caps.append(sliding_pool_pages(layout.window, page_size, max_num_seqs, max_batch_tokens))
    if num_pages:
        primary = num_pages
    else:
        secondary = sum(cap * layout.page_bytes for cap, layout in zip(caps, layouts[1:], strict=True))
        primary = int((budget_bytes - secondary) // layouts[0].page_bytes)
        if caps and primary < max(caps):
            # Too small a budget for the sliding pools' caps: split it evenly, every pool the same pages.
            primary = int(budget_bytes // sum(layout.page_bytes for layout in layouts))
        primary = max(1, primary)
    return [primary] + [min(primary, cap) for cap in caps]


PageTables = tuple[tuple[int, ...], ...]
"""One request's pages per group, in group order (-1: a page the sliding window released)."""

NO_NEW_PAGES: PageTables = ((),)
"""What a one-pool `allocate` returns when the request's last page still has room (most decode steps)."""


class KVCacheManager:
    """The only KV-cache interface the scheduler sees: one `PagePool` per group, driven together.

    The first pool is the primary one: it bounds admission, and its counters are the engine's cache statistics.
    Whether a request can get more tokens is answered in one place, `allocate`, which either takes pages in every
    pool and says which ones, or takes none.
    """

    def __init__(self, layouts: list[GroupLayout], pools: list[PagePool], states: StateSlots | None = None) -> None:
        """`states`: the slots of a model with recurrent layers (None: attention only). A request then needs a
        slot as well as pages to run (`allocate` takes it with its first pages), and no prefix is ever shared: a
        cached page holds K and V, not the recurrent state at its end."""
        if len(layouts) != len(pools) or not pools:
            raise ValueError("one PagePool per group layout, at least one")
        if states is not None and any(pool.enable_prefix_caching for pool in pools):
            raise ValueError("a model with recurrent state shares no prefix: its pools cache none")
        self.layouts = layouts
        self.pools = pools
        self.states = states
        self._primary = pools[0]
        self._single = len(pools) == 1 and states is None

    # -- the primary pool's view: admission, limits and statistics --------------------------------------------

    @property
    def num_pages(self) -> int:
        return self._primary.num_pages

    @property
    def num_free_pages(self) -> int:
        return self._primary.num_free_pages

    @property
    def usage(self) -> float:
        """The fraction of the cache's memory in use: the primary pool's pages, or for a model with no attention
        layer (pages of no bytes) its state slots."""
        if self.states is not None and self.layouts[0].page_bytes == 0:
            return self.states.usage
        return self._primary.usage

    @property
    def prefix_queries(self) -> int:
        return self._primary.prefix_queries

    @property
    def prefix_hits(self) -> int:
        return self._primary.prefix_hits

    def fits(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` tokens fits in the whole cache at all."""
        return self._primary.pages_needed(num_tokens) <= self._primary.num_pages

    def prefix_in_flight(self, request: Request) -> bool:
        # Every pool computes the same tokens in the same step, so the primary pool's answer holds for all.
        return self._primary.prefix_in_flight(request)

    # -- every pool ---------------------------------------------------------------------------------------------

    def state_slot(self, request_id: str) -> int | None:
        """The request's recurrent-state slot; None for a model without recurrent layers."""
        return None if self.states is None else self.states.slot(request_id)

    def page_tables(self, request_id: str) -> PageTables:
        """The request's whole page table in every pool (a copy)."""
        return tuple(tuple(pool.page_table(request_id)) for pool in self.pools)

    def match_prefix(self, request: Request) -> int:
        """The longest prefix every pool holds: a token's K/V must be cached for all layers to be skipped."""
        if self._single:
            return self._primary.match_prefix(request)
        # A sliding pool's hit lengths need not be every length below its longest (a shorter prefix may need a
        # page it evicted), so shrink until every pool holds exactly the same prefix.
        common = min(pool.cached_prefix_tokens(request) for pool in self.pools)
        while True:
            agreed = min(pool.cached_prefix_tokens(request, max_tokens=common) for pool in self.pools)
            if agreed == common:
                break
            common = agreed
        for pool in self.pools:
            if pool.match_prefix(request, max_tokens=common) != common:
                raise AssertionError("a pool matched another prefix than the one all pools agreed on")
        return common

    def allocate(self, request: Request, num_new_tokens: int, keep_free: int = 0) -> PageTables | None:
        """Pages for `num_new_tokens` more tokens in every pool, or None (nothing taken) when they do not fit.

        `keep_free` primary pages must stay free afterwards (the admission margin). Returns, per group, the pages
        newly appended to the request's table (often none: the last page still has room).
        """
        if self._single:
            pages = self._primary.allocate(request, num_new_tokens, keep_free)
            if pages is None:
                return None
            return (tuple(pages),) if pages else NO_NEW_PAGES
        if not self._primary.can_allocate(request, num_new_tokens, keep_free) or not all(
            pool.can_allocate(request, num_new_tokens) for pool in self.pools[1:]
        ):
            return None
        if self.states is not None and self.states.take(request.request_id) is None:
            return None
        grants = []
        for pool in self.pools:
            pages = pool.allocate(request, num_new_tokens, keep_free if pool is self._primary else 0)
            if pages is None:
                raise AssertionError("a pool refused pages can_allocate promised")
            grants.append(tuple(pages))
        return tuple(grants)

    def commit(self, request: Request) -> None:
        """Record that `request.num_computed_tokens` advanced: full pages join the prefix cache."""
        if self._single:
            self._primary.commit(request)
            return
        for pool in self.pools:
            pool.commit(request)

    def shrink(self, request: Request, num_tokens: int) -> tuple[int, ...] | None:
        """Keep only the pages `num_tokens` tokens need in every pool; the table lengths per group when any page
        went (the runner cuts its tables to them), else None."""
        shrunk = [pool.shrink(request, num_tokens) for pool in self.pools]
        if not any(shrunk):
            return None
        return tuple(len(pool.page_table(request.request_id)) for pool in self.pools)

    def free(self, request_id: str) -> None:
        for pool in self.pools:
            pool.free(request_id)
        if self.states is not None:
            self.states.free(request_id)

    def all_free(self) -> bool:
        """Every page of every pool is free or merely cached."""
        return all(pool.num_free_pages == pool.num_pages for pool in self.pools)

    def check_invariants(self) -> None:
        for pool in self.pools:
            pool.check_invariants()
        if self.states is not None:
            self.states.check_invariants()
