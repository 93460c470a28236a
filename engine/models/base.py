"""The interface every model the runner drives implements, native or the transformers fallback."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

from engine.attention.base import AttentionNeeds
from engine.attention.spec import CacheSpec


@runtime_checkable
class CausalLM(Protocol):
    """A causal LM on the packed `[T]` row of one step (no batch dimension)."""

    num_layers: int

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states `[T, hidden]` of the step's tokens (after the last norm: what pooling reads,
        and what `compute_logits` projects).

        `input_ids` `[T]`; `inputs_embeds` `[T, hidden]`, when given, is used instead of embedding `input_ids`
        (image features spliced into a prompt). `positions` is `[T]`, or `[axes, T]` for a model with several
        rotary axes (M-RoPE); a model with one axis raises ValueError for `[axes, T]`. `kv_caches[i]` is layer i's
        K/V pages. It runs inside the step context the runner enters (engine/attention/context.py), where each
        layer's attention finds its cache group's metadata.
        """
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits `[rows, vocab]` of `hidden`'s rows; None on tensor-parallel ranks other than 0."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint `(name, tensor)` pairs, named as transformers names them."""
        ...

    def cache_specs(self) -> list[CacheSpec]:
        """One spec per layer: what its cache holds (heads, dtype, window), what the KV cache is grouped, sized and
        allocated from (engine/execution/kv_caches.py)."""
        ...

    def attention_needs(self) -> AttentionNeeds:
        """What its layers ask of the attention backend beyond causal attention (sliding windows, soft-capping,
        ALiBi, sinks): the loader selects a backend that computes them, or refuses the one asked for by name."""
        ...


Module = TypeVar("Module", bound=nn.Module)


def built_empty(make: Callable[[], Module], device: torch.device, dtype: torch.dtype) -> Module:
    """`make()`'s modules with uninitialised parameters of `dtype` on `device`, for weights to be loaded into.

    Built on the meta device first: nothing is initialised only to be overwritten, and no float32 copy of the
    parameters ever exists. `dtype` is the default while the modules are made, rather than a cast after: a quantized
    linear's codes and scales are made in their own dtypes (int8, e4m3, float32) and must stay so. What a model
    computes rather than loads (rotary tables, a tied head's shared matrix) is the caller's to fill in after."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = make()
    finally:
        torch.set_default_dtype(default)
    # What `Module.to_empty` does, each module's tensors anew, but through `torch.empty`: its `empty_like` of a meta
    # tensor runs torch's reference implementation, which imports sympy (~0.3 s of an engine's start).
    for module in model.modules():
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            empty = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            if isinstance(tensor, nn.Parameter):
                empty = nn.Parameter(empty, requires_grad=tensor.requires_grad)
            setattr(module, name, empty)
    return model
