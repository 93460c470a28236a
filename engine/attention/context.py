"""The step a forward pass computes, as every attention layer of either model path reads it.

The runner enters one `StepContext` around each forward pass (`step_context`), for native models and transformers
models alike. Attention finds the step's metadata there rather than in its arguments, because neither path can
pass it down: a compiled native graph takes tensors only (`ferry::layer_attention`, engine/attention/graph_op.py,
looks its metadata up by sliding window, so a layer's number never enters the graph), and transformers offers no
per-call channel down to every architecture's attention (engine/models/hf_attention.py looks it up by layer).

The context is per thread: under async scheduling the runner's forward pass runs on a thread of its own, and
engines in other threads run steps of their own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.attention.base import AttentionBackend, AttentionFeature, StepMetadata

if TYPE_CHECKING:
    from engine.layers.ssm import StateStep
    from engine.lora.batch import LoRABatch


@dataclass(frozen=True)
class AttentionCall:
    """What one layer's call into the paged backend asked for; the transformers adapter's load-time probe checks
    these."""

    layer: int
    kv_heads: int
    key_dim: int
    value_dim: int
    sliding_window: int | None
    causal: bool
    own_mask: bool
    """The model built an attention mask of its own, which the paged backend would not apply."""
    unimplemented: tuple[str, ...]
    """Arguments that change the result and that the paged backends do not implement."""
    features: frozenset[AttentionFeature] = frozenset()
    """What the call asks of the backend beyond causal attention: what the model needs of it."""


@dataclass
class StepContext:
    backend: AttentionBackend
    layer_metas: Sequence[StepMetadata]
    """Layer i's KV-cache group's metadata."""
    sliding_windows: Sequence[int | None]
    """Layer i's sliding window (None: full attention); the KV-cache groups are the distinct windows."""
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    """Layer i's K and V pages."""
    on_call: Callable[[AttentionCall], None] | None = None
    """Called before each layer's attention runs (the transformers adapter's load-time probe); None while serving."""
    lora: LoRABatch | None = None
    """The step's tokens by LoRA adapter slot, which the adapted linear layers read; None: no token has one."""
    states: StateStep | None = None
    """The step's sequences' recurrent-state slots, which the state-space layers read (engine/layers/ssm.py); None
    for a model without them."""
    by_window: dict[int | None, StepMetadata] = field(init=False)
    """Each group's metadata by its layers' sliding window: what a compiled layer, which knows only its window,
    reads."""

    def __post_init__(self) -> None:
        self.by_window = dict(zip(self.sliding_windows, self.layer_metas, strict=True))


class _Active(threading.local):
    context: StepContext | None = None


_active = _Active()


@contextmanager
def step_context(context: StepContext) -> Iterator[None]:
    """Make `context` the step that attention on this thread reads until the block ends."""
    _active.context = context
    try:
        yield
    finally:
        _active.context = None


def step_lora() -> LoRABatch | None:
    """The LoRA batch of the step running on this thread; None without adapters (or outside a step)."""
    context = _active.context
    return None if context is None else context.lora


def step_states() -> StateStep:
    """The recurrent-state slots of the step running on this thread (a state-space layer's forward)."""
    states = current_step().states
    if states is None:
        raise RuntimeError("a state-space layer ran in a step without state slots (the runner builds them for a "
                           "model whose cache specs declare recurrent states)")  # fmt: skip
    return states


def current_step() -> StepContext:
    """The step whose forward pass runs on this thread."""
    context = _active.context
    if context is None:
        raise RuntimeError("paged attention called outside an engine step (no step_context is active)")
    return context
