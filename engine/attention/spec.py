"""What one layer's cache is: the per-layer cache specs a model declares (`CausalLM.cache_specs`), each carrying
what sizing its pages needs.

Today's models produce `FullAttentionSpec`, `SlidingWindowSpec` and `LatentAttentionSpec` (MLA: one compressed
latent and its rotary key per token instead of K and V heads); `RecurrentStateSpec` is a state-space
layer's (Mamba, Mamba2: a fixed-size state per sequence, not per token, in slots rather than pages);
`NoCacheSpec` (a layer that keeps nothing between steps) is a shape other families bring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class FullAttentionSpec:
    """K and V of `num_kv_heads` heads of `head_size` for every token of the sequence."""

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def window(self) -> None:
        """No window: every token is kept (what grouping reads beside a sliding spec's window)."""
        return None

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_size * _element_bytes(self.dtype)


@dataclass(frozen=True)
class SlidingWindowSpec:
    """As full attention, but a token attends to the last `window` positions only."""

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    window: int

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_size * _element_bytes(self.dtype)


@dataclass(frozen=True)
class LatentAttentionSpec:
    """Multi-head latent attention (DeepSeek's MLA): per token one latent vector of `latent_size` (kv_lora_rank) and
    one rotary key part of `rope_size`, shared by every head, from which attention works without expanding heads.

    Its pages are one tensor `[pages, page_size, 1, latent_size + rope_size]` serving as the keys and, through their
    first `latent_size` columns, the values of a single KV head (engine/models/deepseek.py): the layer passes it as
    both halves of its `(K, V)` pair."""

    latent_size: int
    rope_size: int
    dtype: torch.dtype

    @property
    def window(self) -> None:
        return None

    @property
    def num_kv_heads(self) -> int:
        return 1

    @property
    def head_size(self) -> int:
        return self.latent_size + self.rope_size

    @property
    def bytes_per_token(self) -> int:
        return (self.latent_size + self.rope_size) * _element_bytes(self.dtype)


@dataclass(frozen=True)
class RecurrentStateSpec:
    """A state per sequence, whatever its length (Mamba's, Mamba2's): the last `conv_shape[-1]` inputs of its
    causal convolution `conv_shape` in `dtype`, and its scan's state `ssm_shape` in float32 (a state summed over
    thousands of steps keeps its precision). Kept in fixed slots, one per running sequence
    (engine/core/state_slots.py), not in pages."""

    conv_shape: tuple[int, ...]
    ssm_shape: tuple[int, ...]
    dtype: torch.dtype
    ssm_dtype: torch.dtype = torch.float32
    bytes_per_token: int = 0

    @property
    def state_bytes(self) -> int:
        conv = _element_bytes(self.dtype) * _count(self.conv_shape)
        return conv + _element_bytes(self.ssm_dtype) * _count(self.ssm_shape)


def _count(shape: tuple[int, ...]) -> int:
    total = 1
    for n in shape:
        total *= n
    return total


@dataclass(frozen=True)
class NoCacheSpec:
    """A layer that keeps nothing between steps."""

    bytes_per_token: int = 0


CacheSpec = FullAttentionSpec | SlidingWindowSpec | LatentAttentionSpec | RecurrentStateSpec | NoCacheSpec

PagedSpec = FullAttentionSpec | SlidingWindowSpec | LatentAttentionSpec
"""The specs the engine allocates today: K and V heads (or one latent) per token, in pages."""


def attention_specs(
    num_kv_heads: int, head_size: int, dtype: torch.dtype, sliding_windows: list[int | None]
) -> list[PagedSpec]:
    """One spec per layer of a model whose layers attend fully (window None) or over a sliding window."""
    return [
        FullAttentionSpec(num_kv_heads, head_size, dtype)
        if window is None
        else SlidingWindowSpec(num_kv_heads, head_size, dtype, window)
        for window in sliding_windows
    ]
