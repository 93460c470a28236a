"""Rotary position embeddings: cos/sin tables for every position, computed once, and their application."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from engine.kernels.library import cpu_kernels_take


def rotary_tables(
    config: PretrainedConfig,
    max_positions: int,
    dtype: torch.dtype,
    module: Callable[[PretrainedConfig], torch.nn.Module] = LlamaRotaryEmbedding,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[max_positions, rotary_dim]`, computed in float32 by the transformers rotary module itself (all rope
    scaling types; `module`: a family's own where it turns fewer dimensions than the head's, as Bamba's does), then
    stored in `dtype`, on the current default device."""
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
