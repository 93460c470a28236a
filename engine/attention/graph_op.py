"""The step's paged attention as one opaque operator, so that `torch.compile` graphs hold it without tracing it.

A backend's `forward` cannot be traced: it reads host lists from the step's metadata, builds its plan in Python
and caches it per step. Inside a compiled graph a layer's attention is therefore `ferry::layer_attention`, an op
registered with `torch.library` whose arguments are tensors and constants only (it declares that it writes the K/V
caches, which inductor then passes in place); dynamo records it as one node, its fake implementation giving the
output's shape, and inductor calls it as an external kernel.

The step's metadata reaches the op through the step context (engine/attention/context.py), which the runner enters
around each forward pass, looked up by sliding window: a layer's metadata is its KV-cache group's, and the groups are
the model's distinct windows (engine/core/kv_cache.py). Keying by window rather than by layer index keeps the layer's
number out of the graph, so one compiled decoder layer serves every layer with the same window.

Eager callers go through the same `paged_attention` function, which calls the backend directly, without the op's
dispatch (a few microseconds a call). Latent attention is `ferry::latent_attention` the same way
(engine/attention/latent.py): its absorbed and expanded forms are chosen per step, from the host lists.
"""

from __future__ import annotations

import torch

from engine.attention.context import current_step


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    step = current_step()
    meta = step.by_window[sliding_window]
    return step.backend.forward(query, key, value, (key_cache, value_cache), meta, scale, sliding_window, sinks=sinks)


_LIBRARY = torch.library.Library("ferry", "FRAGMENT")
# A plain library definition, not `torch.library.custom_op`: its dispatch costs a third as much per call.
_LIBRARY.define(
    "layer_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "float scale, int? sliding_window, Tensor? sinks=None) -> Tensor"
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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return torch.empty_like(query)


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,  # [H] float32
) -> torch.Tensor:  # [T, H, D]
    """Write the step's K/V into `kv_cache` and attend over each sequence's pages (the active step's backend);
    `sinks`: the layer's attention sinks, as `AttentionBackend.forward` takes them."""
    if torch.compiler.is_compiling():
        return torch.ops.ferry.layer_attention(
            query, key, value, kv_cache[0], kv_cache[1], scale, sliding_window, sinks
        )
    return _attend(query, key, value, kv_cache[0], kv_cache[1], scale, sliding_window, sinks)
