"""The KV cache's tensors, from the layers' cache specs (`CausalLM.cache_specs`, engine/attention/spec.py): which
specs the engine can page, the groups they form (engine/core/kv_cache.py), and each layer's K and V pages; and a
recurrent layer's state slots.

A latent layer's pages are one tensor, its K and V at once (`LatentAttentionSpec`): a page holds the latent's real
bytes per token, not expanded heads. A recurrent layer (`RecurrentStateSpec`: Mamba's, Mamba2's) pages nothing: its
"cache" is the pair (convolution states, scan states), one row per state slot (engine/core/state_slots.py). A
model with no attention layer at all still has one (empty) page group: the scheduler counts tokens in pages of
no bytes, the same way for every model. A spec the engine cannot allocate (`NoCacheSpec`) is refused by name at
start-up.

`--kv-cache-dtype` other than `auto` replaces the dtype of every attention layer's spec, so a page's bytes, the
pool sizes drawn from the memory budget and `max_model_len`'s fit all count the cache's own elements (a float8 page
is half a bfloat16 one), and the tensors are allocated in it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from engine.attention.spec import (
    CacheSpec,
    FullAttentionSpec,
    LatentAttentionSpec,
    PagedSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
)
from engine.config import CacheConfig, EngineStartupError
from engine.core.kv_cache import GroupLayout, group_layers
from engine.models.base import CausalLM

KV_CACHE_DTYPES: dict[str, torch.dtype] = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
"""The dtype each `--kv-cache-dtype` other than `auto` stores K and V in."""


def kv_cache_dtype(cache: CacheConfig) -> torch.dtype | None:
    """What `--kv-cache-dtype` stores every layer's K and V in; None for `auto` (each spec's own: the model's)."""
    return KV_CACHE_DTYPES.get(cache.kv_cache_dtype)


LayerSpec = PagedSpec | RecurrentStateSpec
"""What the engine allocates per layer: pages, or state slots."""


def layer_specs(model: CausalLM, cache_dtype: torch.dtype | None = None) -> list[LayerSpec]:
    """The model's cache specs, each one the engine allocates (paged attention, or a recurrent state), the paged
    ones in `cache_dtype` when given (`kv_cache_dtype`); EngineStartupError naming the others and their layers."""
    specs = model.cache_specs()
    if len(specs) != model.num_layers:
        raise EngineStartupError(f"the model declares {len(specs)} cache specs for {model.num_layers} layers")
    checked = [_allocatable(layer, spec) for layer, spec in enumerate(specs)]
    if cache_dtype is None:
        return checked
    return [spec if isinstance(spec, RecurrentStateSpec) else dataclasses.replace(spec, dtype=cache_dtype)
            for spec in checked]  # fmt: skip


def _allocatable(layer: int, spec: CacheSpec) -> LayerSpec:
    if isinstance(spec, FullAttentionSpec | SlidingWindowSpec | LatentAttentionSpec | RecurrentStateSpec):
        return spec
    raise EngineStartupError(
        f"layer {layer} keeps a {type(spec).__name__} cache, which Ferry cannot allocate yet: its caches hold the K "
        "and V heads of full or sliding-window attention, a latent (MLA), or a state-space layer's state"
    )


def state_bytes_per_sequence(specs: list[LayerSpec]) -> int:
    """What one sequence's recurrent states take over all layers (0: an attention-only model)."""
    return sum(spec.state_bytes for spec in specs if isinstance(spec, RecurrentStateSpec))


def kv_cache_groups(model: CausalLM, page_size: int, cache_dtype: torch.dtype | None = None) -> list[GroupLayout]:
    """The model's attention layers grouped by what their caches keep, the primary group first
    (engine/core/kv_cache.py), each group's page bytes counted in `cache_dtype` when given; one empty group for a
    model without attention layers."""
    specs = layer_specs(model, cache_dtype)
    paged = [(layer, spec) for layer, spec in enumerate(specs) if not isinstance(spec, RecurrentStateSpec)]
    if not paged:
        return [GroupLayout(window=None, layers=(), page_bytes=0)]
    layouts = group_layers([spec for _, spec in paged], page_size)
    layer_of = [layer for layer, _ in paged]
    return [dataclasses.replace(layout, layers=tuple(layer_of[i] for i in layout.layers)) for layout in layouts]


def allocate_kv_caches(
    specs: list[LayerSpec],
    group_of_layer: list[int],
    pool_pages: list[int],
    page_size: int,
    num_state_slots: int,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's cache, shaped and typed by its spec: an attention layer's K and V pages, its group's pool and
    one scratch page past it (what padded decode rows use), a latent layer's one tensor being both; a recurrent
    layer's convolution and scan states, one row per slot."""
    caches = []
    for layer, spec in enumerate(specs):
        if isinstance(spec, RecurrentStateSpec):
            conv = torch.zeros((num_state_slots, *spec.conv_shape), dtype=spec.dtype, device=device)
            caches.append((conv, torch.zeros((num_state_slots, *spec.ssm_shape), dtype=spec.ssm_dtype, device=device)))
            continue
        shape = (pool_pages[group_of_layer[layer]] + 1, page_size, spec.num_kv_heads, spec.head_size)
        keys = _pages(shape, spec.dtype, device)
        values = keys if isinstance(spec, LatentAttentionSpec) else _pages(shape, spec.dtype, device)
        caches.append((keys, values))
    return caches


def _pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeroed pages. On the CPU in memory the operating system zeroes as it is first written (numpy's calloc of fresh
    anonymous memory: 4 KiB pages, or 2 MiB ones where numpy asks for huge pages) rather than filled up front: a pool
    sized to the machine's memory is mostly unwritten for a long while, and torch.zeros' fill of the demo model's
    537 MB pool took 0.4 s of every start. Either way every element reads zero until written (kernels read a padded
    page's slots under a mask). The pool is committed as it fills, not at start. Aligned to 64 bytes, as torch's own
    allocator aligns (numpy's buffer may start 16 bytes into a cache line)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * dtype.itemsize
    memory = np.zeros(size + _ALIGNMENT, dtype=np.uint8)
    start = -memory.ctypes.data % _ALIGNMENT
    return torch.from_numpy(memory[start : start + size]).view(dtype).view(shape)


_ALIGNMENT = 64
