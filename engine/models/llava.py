"""LLaVA (1.5): a CLIP vision tower and a two-layer projector in front of a Llama-family language model
(engine/models/vision_language.py). An image is one size (the processor resizes and crops it), so a step's images
encode in one vision-tower call."""

from __future__ import annotations

from typing import ClassVar

import torch
from transformers import AutoModel, PretrainedConfig
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

from engine.models.vision_language import VisionLanguageModel
from engine.multimodal.inputs import ImageInput


class LlavaForConditionalGeneration(VisionLanguageModel):
    PREFIXES: ClassVar[tuple[tuple[str, str, str], ...]] = (
        # transformers 5's layout, then the layout of checkpoints saved before it (llava-hf on the Hub).
        ("model.language_model.", "language_model", "model."),
        ("lm_head.", "language_model", "lm_head."),
        ("model.vision_tower.", "vision_tower", ""),
        ("model.multi_modal_projector.", "multi_modal_projector", ""),
        ("language_model.model.", "language_model", "model."),
        ("language_model.lm_head.", "language_model", "lm_head."),
        ("vision_tower.", "vision_tower", ""),
        ("multi_modal_projector.", "multi_modal_projector", ""),
    )

    def build_vision(self, config: PretrainedConfig) -> None:
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(config)
        self.feature_layer = config.vision_feature_layer
        self.select_strategy = config.vision_feature_select_strategy

    @torch.no_grad()
    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        dtype, device = self._vision_dtype_device()
        pixels = torch.stack([torch.from_numpy(image.data["pixel_values"]) for image in images]).to(device, dtype)
        out = self.vision_tower(pixels, output_hidden_states=True)  # hidden_states: layers + 1 x [N, 1 + P, vh]
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else list(self.feature_layer)
        selected = [out.hidden_states[layer] for layer in layers]
        if self.select_strategy == "default":  # the CLS position is dropped
            selected = [hidden[:, 1:] for hidden in selected]
        features = self.multi_modal_projector(torch.cat(selected, dim=-1))  # [N, P, hidden]
        for image, feature in zip(images, features, strict=True):
            if feature.shape[0] != image.length:
                raise ValueError(f"an image encoded to {feature.shape[0]} embeddings for {image.length} tokens")
        return list(features)
