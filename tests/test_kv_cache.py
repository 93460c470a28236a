"""KVCacheManager: one page pool per attention kind (group), so a hybrid model's sliding layers forget old pages.

Pure Python, no model: a primary (full attention) pool next to a sliding-window pool.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.attention.spec import FullAttentionSpec, SlidingWindowSpec
from engine.core.kv_cache import GroupLayout, KVCacheManager, group_layers, pool_pages, sliding_pool_pages
from engine.core.page_pool import PagePool
from engine.core.request import Request
from tests.test_page_pool import make_request

WINDOW, PAGE = 8, 4


def hybrid(primary_pages: int = 32, sliding_pages: int = 16) -> KVCacheManager:
    layouts = [GroupLayout(None, (0, 2), 1), GroupLayout(WINDOW, (1, 3), 1)]
    pools = [
        PagePool(primary_pages, PAGE, debug_checks=True),
        PagePool(sliding_pages, PAGE, sliding_window=WINDOW, debug_checks=True),
    ]
    return KVCacheManager(layouts, pools)


def compute(groups: KVCacheManager, request: Request, num_new: int) -> None:
    assert groups.allocate(request, num_new) is not None
    request.num_computed_tokens += num_new
    groups.commit(request)


def _spec(window: int | None, kv_heads: int = 2, head_size: int = 8, dtype: torch.dtype = torch.float32):
    if window is None:
        return FullAttentionSpec(kv_heads, head_size, dtype)
    return SlidingWindowSpec(kv_heads, head_size, dtype, window)


def _specs(windows: list[int | None]) -> list[FullAttentionSpec | SlidingWindowSpec]:
    return [_spec(window) for window in windows]


LAYER_PAGE = 2 * 2 * 8 * 4 * PAGE  # K and V, 2 heads of 8 float32, a page of PAGE tokens


def test_layers_group_by_window_full_attention_first() -> None:
    assert group_layers(_specs([None, None]), PAGE) == [GroupLayout(None, (0, 1), 2 * LAYER_PAGE)]
    assert group_layers(_specs([24, 24, 24]), PAGE) == [GroupLayout(24, (0, 1, 2), 3 * LAYER_PAGE)]
    assert group_layers(_specs([8, None, 8, None]), PAGE) == [
        GroupLayout(None, (1, 3), 2 * LAYER_PAGE),
        GroupLayout(8, (0, 2), 2 * LAYER_PAGE),
    ]
    # No full layer: the widest window bounds admission.
    assert group_layers(_specs([8, 32, 8]), PAGE) == [
        GroupLayout(32, (1,), LAYER_PAGE),
        GroupLayout(8, (0, 2), 2 * LAYER_PAGE),
    ]


def test_a_group_page_holds_what_each_layer_spec_keeps() -> None:
    """Heads and dtypes may differ across layers: a page is sized from each layer's own spec."""
    specs = [_spec(None, 4, 16, torch.bfloat16), _spec(16, 1, 8, torch.float32), _spec(None, 2, 8, torch.float16)]
    layouts = group_layers(specs, PAGE)
    assert [(layout.window, layout.layers) for layout in layouts] == [(None, (0, 2)), (16, (1,))]
    assert [layout.page_bytes for layout in layouts] == [PAGE * (2 * 4 * 16 * 2 + 2 * 2 * 8 * 2), PAGE * 2 * 8 * 4]
    # A budget for 20 primary pages beside the sliding pool's cap: the bytes of each group's pages, not a count of
    # layers times one layer's page.
    cap = sliding_pool_pages(16, PAGE, max_num_seqs=2, max_batch_tokens=8)
    budget = 20 * layouts[0].page_bytes + cap * layouts[1].page_bytes
    pages = pool_pages(layouts, num_pages=None, budget_bytes=budget, page_size=PAGE, max_num_seqs=2, max_batch_tokens=8)
    assert pages == [20, cap] == [20, 14]


@given(st.lists(st.sampled_from([None, 4, 8, 32]), min_size=1, max_size=12), st.sampled_from([1, 4, 16]))
def test_groups_partition_the_layers_by_window(windows: list[int | None], page_size: int) -> None:
    layouts = group_layers(_specs(windows), page_size)
    assert sorted(layer for layout in layouts for layer in layout.layers) == list(range(len(windows)))
    assert len({layout.window for layout in layouts}) == len(layouts)
    for layout in layouts:
        assert all(windows[layer] == layout.window for layer in layout.layers)
        assert layout.page_bytes == len(layout.layers) * page_size * 2 * 2 * 8 * 4
    primary = layouts[0].window
    assert primary is None if None in windows else primary == max(w for w in windows if w is not None)


def test_sliding_pool_holds_every_running_window() -> None:
    # Per sequence: 2 pages of window + a partly outside page + a partly filled one; plus one step's tokens.
    assert sliding_pool_pages(8, 4, max_num_seqs=3, max_batch_tokens=10) == 3 * 4 + 3


def test_sliding_pool_releases_while_primary_keeps_every_page() -> None:
    groups = hybrid()
    request = make_request("a", list(range(40)))
    assert groups.match_prefix(request) == 0
    compute(groups, request, 40)
    primary, sliding = groups.page_tables("a")
    assert len(primary) == 10 and -1 not in primary
    assert sliding[:8] == (-1,) * 8, "pages before the window of the next token are released"
    assert tuple(p for p in sliding if p >= 0) == sliding[8:]
    assert groups.pools[1].num_free_pages == 16 - 2
    groups.free("a")
    assert groups.all_free()
    groups.check_invariants()


def test_allocation_is_all_pools_or_none() -> None:
    groups = hybrid(primary_pages=32, sliding_pages=3)
    request = make_request("a", list(range(20)))
    groups.match_prefix(request)
    # The sliding pool cannot hold 5 pages at once: nothing is taken from the primary pool either.
    assert groups.allocate(request, 20) is None
    assert groups.pools[0].num_free_pages == 32 and groups.pools[1].num_free_pages == 3
    # In chunks it fits: the window lets go of pages as it moves.
    for _ in range(5):
        compute(groups, request, 4)
    assert request.num_computed_tokens == 20
    groups.check_invariants()


def test_prefix_hit_is_one_every_pool_holds() -> None:
    groups = hybrid(primary_pages=32, sliding_pages=4)
    first = make_request("a", list(range(33)))
    groups.match_prefix(first)
    for _ in range(8):
        compute(groups, first, 4)
    compute(groups, first, 1)
    groups.free("a")
    # The primary pool kept every page of the prefix; the small sliding pool has had to reuse its early pages.
    same = make_request("b", list(range(33)))
    primary_hit = groups.pools[0].cached_prefix_tokens(same)
    sliding_hit = groups.pools[1].cached_prefix_tokens(same)
    assert primary_hit == 32
    short = make_request("c", list(range(9)))
    assert groups.pools[0].cached_prefix_tokens(short) == 8
    assert groups.pools[1].cached_prefix_tokens(short) == 0, "the sliding pool reused its first pages"
    assert groups.match_prefix(short) == 0
    groups.free("c")
    hit = groups.match_prefix(same)
    assert hit == min(primary_hit, sliding_hit)
    same.num_computed_tokens = hit
    assert groups.page_tables("b")[0] != ()
    compute(groups, same, same.num_tokens - hit)
    groups.free("b")
    assert groups.all_free()
    groups.check_invariants()


def test_sliding_pool_hits_need_only_the_window() -> None:
    """A continuation reads only its window: earlier pages may be gone and the prefix still counts."""
    pool = PagePool(6, PAGE, sliding_window=WINDOW, debug_checks=True)
    request = make_request("a", list(range(25)))
    for _ in range(6):
        assert pool.allocate(request, 4) is not None
        request.num_computed_tokens += 4
        pool.commit(request)
    pool.free("a")
    # Evict the first cached pages by taking pages for an unrelated request.
    other = make_request("x", [999] * 8)
    assert pool.allocate(other, 8) is not None
    pool.free("x")
    again = make_request("b", list(range(25)))
    assert pool.cached_prefix_tokens(again) == 24
    assert pool.match_prefix(again) == 24
    assert pool.page_table("b")[:4] == [-1] * 4
    pool.free("b")
    pool.check_invariants()


def test_groups_need_one_pool_each() -> None:
    with pytest.raises(ValueError):
        KVCacheManager([GroupLayout(None, (0,), 1)], [])
