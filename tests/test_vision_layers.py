"""The vision encoders' layers Ferry computes itself, against transformers' modules on the same weights and inputs:
QuickGELU (CLIP's and Qwen2-VL's MLPs) and Qwen2-VL's vision attention with its float32 rotary in one kernel call.
float32 within float32 rounding; bfloat16 where the roundings are transformers' own (QuickGELU bit for bit). The
engine's image oracle (tests/test_images.py) runs them inside whole models."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import QuickGELUActivation
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionAttention as TransformersVisionAttention
from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

from engine.layers.activation import QuickGELU
from engine.layers.rotary import apply_rotary_widened
from engine.models.qwen2_vl import VisionAttention


def _tables(patches: int, head_dim: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[patches, head_dim]` float32 as the vision model builds them: one angle per pair, both halves."""
    angles = torch.rand(patches, head_dim // 2, generator=generator) * 40
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def test_quick_gelu_rounds_as_transformers_does() -> None:
    x = torch.randn(257, 300, generator=torch.Generator().manual_seed(0)) * 4
    x[0, :4] = torch.tensor([0.0, -0.0, 60.0, -60.0])  # exp's clamps and both zeros
    torch.testing.assert_close(QuickGELU()(x), QuickGELUActivation()(x), atol=1e-6, rtol=1e-6)
    bf16 = x.to(torch.bfloat16)
    assert torch.equal(QuickGELU()(bf16), QuickGELUActivation()(bf16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_widened_rotary_is_transformers_vision_rotary(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    qkv = torch.randn(300, 3, 6, 40, generator=generator).to(dtype)
    q = qkv.unbind(1)[0]  # strided, as the attention's view of its qkv projection is
    cos, sin = _tables(300, 40, generator)
    want, _ = apply_rotary_pos_emb_vision(q, q, cos, sin)
    got = apply_rotary_widened(q, cos, sin)
    assert got.dtype == dtype
    # float32 maths in both, rounded once: float32 within its rounding; bfloat16 within one of its steps.
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vision_attention_equals_transformers(dtype: torch.dtype) -> None:
    """Two images of 40 and 60 patches: each attends only to its own (a mix-up between them fails), heads scaled as
    transformers scales them."""
    config = Qwen2VLVisionConfig(embed_dim=64, num_heads=4)
    config._attn_implementation = "sdpa"
    torch.manual_seed(2)
    theirs = TransformersVisionAttention(config).to(dtype).eval()
    ours = VisionAttention(theirs)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(100, 64, generator=generator).to(dtype)
    cu_seqlens = torch.tensor([0, 40, 100], dtype=torch.int32)
    tables = _tables(100, 16, generator)
    with torch.no_grad():
        want = theirs(hidden, cu_seqlens=cu_seqlens, position_embeddings=tables)
        got = ours(hidden, cu_seqlens=cu_seqlens, position_embeddings=tables)
        one_image = ours(hidden, cu_seqlens=torch.tensor([0, 100], dtype=torch.int32), position_embeddings=tables)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
    assert not torch.allclose(one_image.float(), want.float(), atol=0.1)
