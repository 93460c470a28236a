"""The KV cache's tensors, from the layers' cache specs (`CausalLM.cache_specs`, engine/attention/spec.py): which
specs the engine can page, the groups they form (engine/core/kv_cache.py), and each layer's K and V pages.

A spec the engine cannot allocate yet (a recurrent state, no cache) is refused here, by name, at start-up: sizing
its pages as K/V heads would be wrong, not merely wasteful. A latent layer's pages are one tensor, its K and V at
once (`LatentAttentionSpec`): a page holds the latent's real bytes per token, not expanded heads.

`--kv-cache-dtype` other than `auto` replaces the dtype of every layer's spec, so a page's bytes, the pool sizes
drawn from the memory budget and `max_model_len`'s fit all count the cache's own elements (a float8 page is half a
bfloat16 one), and the tensors are allocated in it.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.attention.spec import CacheSpec, FullAttentionSpec, LatentAttentionSpec, PagedSpec, SlidingWindowSpec
from engine.config import CacheConfig, EngineStartupError
from engine.core.kv_cache import GroupLayout, group_layers
from engine.models.base import CausalLM

KV_CACHE_DTYPES: dict[str, torch.dtype] = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
"""The dtype each `--kv-cache-dtype` other than `auto` stores K and V in."""


def kv_cache_dtype(cache: CacheConfig) -> torch.dtype | None:
    """What `--kv-cache-dtype` stores every layer's K and V in; None for `auto` (each spec's own: the model's)."""
    return KV_CACHE_DTYPES.get(cache.kv_cache_dtype)


def paged_specs(model: CausalLM, cache_dtype: torch.dtype | None = None) -> list[PagedSpec]:
    """The model's cache specs, each one the engine pages (full or sliding-window attention), in `cache_dtype` when
    given (`kv_cache_dtype`); EngineStartupError naming the others and their layers."""
    specs = model.cache_specs()
    if len(specs) != model.num_layers:
        raise EngineStartupError(f"the model declares {len(specs)} cache specs for {model.num_layers} layers")
    paged = [_paged(layer, spec) for layer, spec in enumerate(specs)]
    return paged if cache_dtype is None else [dataclasses.replace(spec, dtype=cache_dtype) for spec in paged]


def _paged(layer: int, spec: CacheSpec) -> PagedSpec:
    if isinstance(spec, FullAttentionSpec | SlidingWindowSpec | LatentAttentionSpec):
        return spec
    raise EngineStartupError(
        f"layer {layer} keeps a {type(spec).__name__} cache, which Ferry cannot allocate yet: its KV cache pages "
        "hold the K and V heads of full or sliding-window attention, or a latent (MLA), only"
    )


def kv_cache_groups(model: CausalLM, page_size: int, cache_dtype: torch.dtype | None = None) -> list[GroupLayout]:
    """The model's layers grouped by what their caches keep, the primary group first (engine/core/kv_cache.py), each
    group's page bytes counted in `cache_dtype` when given."""
    return group_layers(paged_specs(model, cache_dtype), page_size)


def allocate_kv_caches(
    specs: list[PagedSpec],
    group_of_layer: list[int],
    pool_pages: list[int],
    page_size: int,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's K and V pages, shaped and typed by its spec: its group's pool, and one scratch page past it
    (what padded decode rows use). A latent layer's one tensor is both."""
    caches = []
    for spec, group in zip(specs, group_of_layer, strict=True):
        shape = (pool_pages[group] + 1, page_size, spec.num_kv_heads, spec.head_size)
        keys = torch.zeros(shape, dtype=spec.dtype, device=device)
        values = keys if isinstance(spec, LatentAttentionSpec) else torch.zeros(shape, dtype=spec.dtype, device=device)
        caches.append((keys, values))
    return caches
