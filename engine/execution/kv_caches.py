"""The KV cache's tensors, from the layers' cache specs (`CausalLM.cache_specs`, engine/attention/spec.py): which
specs the engine can page, the groups they form (engine/core/kv_cache.py), and each layer's K and V pages.

A spec the engine cannot allocate yet (a latent, a recurrent state, no cache) is refused here, by name, at start-up:
sizing its pages as K/V heads would be wrong, not merely wasteful.
"""

from __future__ import annotations

import torch

from engine.attention.spec import CacheSpec, FullAttentionSpec, PagedSpec, SlidingWindowSpec
from engine.config import EngineStartupError
from engine.core.kv_cache import GroupLayout, group_layers
from engine.models.base import CausalLM


def paged_specs(model: CausalLM) -> list[PagedSpec]:
    """The model's cache specs, each one the engine pages (full or sliding-window attention); EngineStartupError
    naming the others and their layers."""
    specs = model.cache_specs()
    if len(specs) != model.num_layers:
        raise EngineStartupError(f"the model declares {len(specs)} cache specs for {model.num_layers} layers")
    return [_paged(layer, spec) for layer, spec in enumerate(specs)]


def _paged(layer: int, spec: CacheSpec) -> PagedSpec:
    if isinstance(spec, FullAttentionSpec | SlidingWindowSpec):
        return spec
    raise EngineStartupError(
        f"layer {layer} keeps a {type(spec).__name__} cache, which Ferry cannot allocate yet: its KV cache pages "
        "hold the K and V heads of full or sliding-window attention only"
    )


def kv_cache_groups(model: CausalLM, page_size: int) -> list[GroupLayout]:
    """The model's layers grouped by what their caches keep, the primary group first (engine/core/kv_cache.py)."""
    return group_layers(paged_specs(model), page_size)


def allocate_kv_caches(
    specs: list[PagedSpec],
    group_of_layer: list[int],
    pool_pages: list[int],
    page_size: int,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's K and V pages, shaped and typed by its spec: its group's pool, and one scratch page past it
    (what padded decode rows use)."""
    caches = []
    for spec, group in zip(specs, group_of_layer, strict=True):
        shape = (pool_pages[group] + 1, page_size, spec.num_kv_heads, spec.head_size)
        caches.append(
            (torch.zeros(shape, dtype=spec.dtype, device=device), torch.zeros(shape, dtype=spec.dtype, device=device))
        )
    return caches
