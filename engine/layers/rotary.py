"""Rotary position embeddings: cos/sin tables for every position, computed once, and their application."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.kernels.library import cpu_kernels_take

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class LlamaRotary(nn.Module):
    """transformers' `LlamaRotaryEmbedding` (the Llama family's and most others' rotary module), stated here on
    transformers' own rope functions so that an engine start does not import the Llama modelling module and with it
    transformers' model-loading machinery (~1.7 s); unscaled rope, computed here, imports no transformers at all.
    tests/test_rotary.py holds it to the original for every rope type, bit for bit."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        # The names dynamic_rope_update reads and updates.
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters["rope_type"]
        if self.rope_type == "default":
            inv_freq, self.attention_scaling = _default_rope_parameters(config)
            self._angles = _angles
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](config)
            # Dynamic and longrope scaling pick their frequencies by the largest position.
            self._angles = dynamic_rope_update(_angles)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._angles(self, x, position_ids)


def _angles(rotary: LlamaRotary, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of `position_ids`' angles at `rotary`'s frequencies, scaled, in `x`'s dtype."""
    freqs = position_ids[..., None].float() * rotary.inv_freq.to(device=x.device, dtype=torch.float)
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * rotary.attention_scaling).to(x.dtype), (angles.sin() * rotary.attention_scaling).to(x.dtype)


def _default_rope_parameters(config: PretrainedConfig) -> tuple[torch.Tensor, float]:
    """Unscaled rope over the whole head: the inverse frequencies, and no attention scaling."""
    base = config.rope_parameters["rope_theta"]
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def rotary_tables(
    config: PretrainedConfig,
    max_positions: int,
    dtype: torch.dtype,
    module: Callable[[PretrainedConfig], nn.Module] = LlamaRotary,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[max_positions, rotary_dim]`, computed in float32 by the rotary module (all rope scaling types;
    `module`: a family's own where it turns fewer dimensions than the head's, as Bamba's does), then stored in
    `dtype`, on the current default device (on the meta device, tables of the right shape: meta `arange` runs torch's
    reference implementation, whose first use imports torch._dynamo, ~1 s of an eager engine's start)."""
    if torch.get_default_device().type == "meta":
        with torch.device("cpu"):
            rotary_dim = rotary_tables(config, 1, dtype, module)[0].shape[-1]
        return torch.empty(max_positions, rotary_dim, dtype=dtype), torch.empty(max_positions, rotary_dim, dtype=dtype)
    rotary = module(config)
    positions = torch.arange(max_positions)[None, :]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    return cos[0].to(dtype), sin[0].to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` `[T, heads, head_dim]` rotated by its tokens' `cos`/`sin` `[T, 1, head_dim]`: on CPU one kernel call
    (engine/kernels/cpu_pointwise.cpp) with this expression's roundings, where torch runs seven ops."""
    if cos.dtype == x.dtype and cpu_kernels_take(x):
        return torch.ops.ferry_kernels.rotary(x, cos, sin)
    return x * cos + _rotate_half(x) * sin


def apply_rotary_widened(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` `[T, heads, head_dim]` rotated by float32 `cos`/`sin` `[T, head_dim]` in float32 and rounded back to its
    dtype once, as transformers' vision encoders rotate (Qwen2-VL's `apply_rotary_pos_emb_vision`): on CPU one
    kernel call, where torch runs nine ops over float32 copies."""
    if cpu_kernels_take(x):
        return torch.ops.ferry_kernels.rotary_widened(x, cos, sin)
    wide = x.float()
    return (wide * cos.unsqueeze(-2) + _rotate_half(wide) * sin.unsqueeze(-2)).to(x.dtype)
