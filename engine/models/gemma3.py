"""Gemma 3: a SigLIP vision tower and a projector (pooling each image's patches to a fixed number of tokens) in
front of Gemma 3's language model, whose image tokens attend to each other in both directions.

Gemma 3's language model has no native modules here (alternating local and global attention layers with rotary
tables of their own, scaled embeddings, GeLU): it runs on transformers' modules through the adapter
(engine/models/hf_adapter.py), with the rest of the model, as the loader builds it (engine/models/loader.py). Each
image's tokens are a non-causal span (`bidirectional_images`): the attention backends give a span's queries the
whole span, and the scheduler computes a span in one step (engine/models/vision_language.py for the rest).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from engine.attention.base import AttentionFeature, AttentionNeeds
from engine.models.vision_language import VisionLanguageModel
from engine.multimodal.inputs import ImageInput


class Gemma3ForConditionalGeneration(VisionLanguageModel):
    bidirectional_images: ClassVar[bool] = True

    def __init__(
        self, config: PretrainedConfig, language_model: nn.Module, vision_tower: nn.Module, projector: nn.Module
    ) -> None:
        """`language_model`: the adapter over transformers' Gemma 3 language model and LM head; the vision tower
        and projector: transformers' modules of the same loaded model."""
        super().__init__(config, language_model)
        self.vision_tower = vision_tower
        self.multi_modal_projector = projector

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Gemma's embedding, scaled by the square root of the hidden size, as its own forward pass embeds."""
        return self.language_model.hf_model.get_input_embeddings()(input_ids[None])[0]

    def attention_needs(self) -> AttentionNeeds:
        needs = self.language_model.attention_needs()
        return AttentionNeeds(needs.features | {AttentionFeature.NONCAUSAL_SPANS}, needs.kv_cache_dtype)

    def fuse_decoder(self) -> None:
        """transformers' modules run as they are."""

    @torch.no_grad()
    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        dtype, device = self._vision_dtype_device()
        pixels = torch.stack([torch.from_numpy(image.data["pixel_values"]) for image in images]).to(device, dtype)
        hidden = self.vision_tower(pixel_values=pixels).last_hidden_state  # [N, patches, vision hidden]
        features = self.multi_modal_projector(hidden)  # [N, mm_tokens_per_image, hidden]
        for image, feature in zip(images, features, strict=True):
            if feature.shape[0] != image.length:
                raise ValueError(f"an image encoded to {feature.shape[0]} embeddings for {image.length} tokens")
        return list(features)
