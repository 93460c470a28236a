"""The step's paged attention as one opaque operator, so that `torch.compile` graphs hold it without tracing it.

A backend's `forward` cannot be traced: it reads host lists from the step's metadata, builds its plan in Python
and caches it per step. Inside a compiled graph a layer's attention is therefore `ferry::layer_attention`, an op
registered with `torch.library` whose arguments are tensors and constants only (it declares that it writes the K/V
caches, which inductor then passes in place); dynamo records it as one node, its fake implementation giving the
output's shape, and inductor calls it as an external kernel.

The step's metadata reaches the op through `attention_step`, set around each forward pass on the engine's thread,
keyed by sliding window: a layer's metadata is its KV-cache group's, and the groups are the model's distinct windows
(engine/core/kv_cache.py). Keying by window rather than by layer index keeps the layer's number out of the graph, so one
compiled decoder layer serves every layer with the same window.

Eager callers go through the same `paged_attention` function, which calls the backend directly, without the op's
dispatch (a few microseconds a call).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend, StepMetadata


@dataclass
class _Step:
    backend: AttentionBackend
    metas: dict[int | None, StepMetadata]
    """Each KV-cache group's metadata, by the sliding window of its layers (None: full attention)."""


class _Active(threading.local):
    """The step whose forward pass runs on this thread (engines in other threads run their own steps)."""

    step: _Step | None = None


_active = _Active()


@contextmanager
def attention_step(backend: AttentionBackend, metas: dict[int | None, StepMetadata]) -> Iterator[None]:
    """Make `metas` (by sliding window) the metadata that `paged_attention` calls on this thread read until the
    block ends."""
    _active.step = _Step(backend, metas)
    try:
        yield
    finally:
        _active.step = None


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    step = _active.step
    if step is None:
        raise RuntimeError("paged attention called outside an engine step (no attention_step is active)")
    meta = step.metas[sliding_window]
    return step.backend.forward(query, key, value, (key_cache, value_cache), meta, scale, sliding_window)


_LIBRARY = torch.library.Library("ferry", "FRAGMENT")
# A plain library definition, not `torch.library.custom_op`: its dispatch costs a third as much per call.
_LIBRARY.define(
    "layer_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "float scale, int? sliding_window) -> Tensor"
)
_LIBRARY.impl("layer_attention", _attend, "CompositeExplicitAutograd")


@torch.library.register_fake("ferry::layer_attention", lib=_LIBRARY)
def _(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    return torch.empty_like(query)


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [T, H, D]
    """Write the step's K/V into `kv_cache` and attend over each sequence's pages (the active step's backend)."""
    if torch.compiler.is_compiling():
        return torch.ops.ferry.layer_attention(query, key, value, kv_cache[0], kv_cache[1], scale, sliding_window)
    return _attend(query, key, value, kv_cache[0], kv_cache[1], scale, sliding_window)
