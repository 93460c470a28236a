"""Qwen2-VL and Qwen2.5-VL: a vision transformer at each image's own resolution (dynamic: an image is a grid of
14-pixel patches, merged 2x2 into one token each) in front of a Qwen2 language model with M-RoPE, whose rotary
positions have three axes: a text token sits at (p, p, p), an image token at its (time, row, column) in the image's
grid, offset past the text before it; the text after an image continues past the image's largest axis
(engine/models/vision_language.py for what image models share)."""

from __future__ import annotations

import itertools
from typing import ClassVar

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from engine.attention.base import dense_attention
from engine.layers.linear_method import LinearMethod
from engine.layers.rotary import apply_rotary_widened
from engine.models.vision_language import VisionLanguageModel
from engine.multimodal.inputs import ImageInput


class VisionAttention(nn.Module):
    """The vision transformer's attention (transformers' `VisionAttention` and `Qwen2_5_VLVisionAttention`, whose
    forward is one, on its SDPA path: each image's patches attend to each other), with q's and k's rotary in one
    kernel call each (`apply_rotary_widened`: float32 maths rounded once, as transformers' rotary widens them),
    where torch ran nine ops over float32 copies, a quarter of the encoder's time on CPU. Takes over the
    module's own linears."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.qkv, self.proj = attention.qkv, attention.proj
        self.num_heads, self.scaling = attention.num_heads, attention.scaling

    def forward(
        self,
        hidden_states: torch.Tensor,  # [patches, dim]
        cu_seqlens: torch.Tensor,  # [images + 1]: where each image's (or window's) patches start
        position_embeddings: tuple[torch.Tensor, torch.Tensor],  # cos, sin [patches, head_dim] float32
        **_: object,  # the block passes on what flash-attention's path reads (max_seqlen)
    ) -> torch.Tensor:
        patches = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).reshape(patches, 3, self.num_heads, -1).unbind(1)  # [patches, h, d] each
        cos, sin = (table.float() for table in position_embeddings)
        q, k = apply_rotary_widened(q, cos, sin), apply_rotary_widened(k, cos, sin)
        out = torch.empty_like(q)
        bounds = cu_seqlens.tolist()
        for first, end in itertools.pairwise(bounds):
            out[first:end] = dense_attention(q[first:end], k[first:end], v[first:end], self.scaling, causal=False)
        return self.proj(out.reshape(patches, -1))


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    PREFIXES: ClassVar[tuple[tuple[str, str | None, str], ...]] = (
        # transformers 5's layout, then the layout of checkpoints saved before it (Qwen's own on the Hub).
        ("model.language_model.", "language_model", "model."),
        ("model.visual.", "visual", ""),
        ("lm_head.", "language_model", "lm_head."),
        ("visual.", "visual", ""),
        ("model.", "language_model", "model."),
    )
    vision_class: ClassVar[type] = Qwen2VisionTransformerPretrainedModel

    def build_vision(self, config: PretrainedConfig) -> None:
        self.visual = self.vision_class._from_config(config.vision_config)
        self.merge = config.vision_config.spatial_merge_size

    def adopt_vision_layers(self, method: LinearMethod) -> None:
        super().adopt_vision_layers(method)
        for block in self.visual.blocks:
            block.attn = VisionAttention(block.attn)

    @property
    def rope_axes(self) -> int:
        return 3

    @torch.no_grad()
    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """All images' patches in one vision call (`[patches, C * T * P * P]` rows, with each image's grid), its
        merged tokens cut back into images."""
        dtype, device = self._vision_dtype_device()
        pixels = torch.cat([torch.from_numpy(image.data["pixel_values"]) for image in images]).to(device, dtype)
        grids = torch.from_numpy(np.stack([image.data["image_grid_thw"] for image in images])).to(device)
        merged = self.visual(pixels, grid_thw=grids).pooler_output  # [sum of tokens, hidden]
        lengths = [image.length for image in images]
        if merged.shape[0] != sum(lengths):
            raise ValueError(f"images encoded to {merged.shape[0]} embeddings for {sum(lengths)} tokens")
        return list(torch.split(merged, lengths))

    def rope_positions(self, num_prompt_tokens: int, images: tuple[ImageInput, ...]) -> tuple[np.ndarray, int] | None:
        if not images:
            return None
        table = np.empty((3, num_prompt_tokens), dtype=np.int64)
        position = cursor = 0  # the next position to give; the next prompt token to place
        for image in images:
            text = image.offset - cursor
            table[:, cursor : image.offset] = position + np.arange(text)
            position += text
            frames, height, width = (int(n) for n in image.data["image_grid_thw"])
            rows, columns = height // self.merge, width // self.merge
            grid = np.indices((frames, rows, columns)).reshape(3, -1)  # (time, row, column) of each token
            table[:, image.offset : image.end] = position + grid
            position += max(height, width) // self.merge
            cursor = image.end
        table[:, cursor:] = position + np.arange(num_prompt_tokens - cursor)
        return table, int(table.max()) + 1 - num_prompt_tokens


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: the same layout with a windowed-attention vision transformer (RMSNorm, SwiGLU)."""

    vision_class: ClassVar[type] = Qwen2_5_VisionTransformerPretrainedModel
