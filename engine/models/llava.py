"""LLaVA 1.5 and LLaVA-NeXT: a CLIP vision tower and a two-layer projector in front of a Llama-family language
model (engine/models/vision_language.py). In 1.5 an image is one size (the processor resizes and crops it), so a
step's images encode in one vision-tower call; in NeXT an image is tiled at a resolution that suits it."""

from __future__ import annotations

import copy
from typing import ClassVar

import numpy as np
import torch
from transformers import AutoModel, PretrainedConfig
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector
from transformers.models.llava_next.modeling_llava_next import LlavaNextModel

from engine.models.vision_language import LANGUAGE_PREFIXES, VisionLanguageModel
from engine.multimodal.inputs import ImageInput


class LlavaForConditionalGeneration(VisionLanguageModel):
    PREFIXES: ClassVar[tuple[tuple[str, str | None, str], ...]] = (
        *LANGUAGE_PREFIXES,
        ("model.vision_tower.", "vision_tower", ""),
        ("model.multi_modal_projector.", "multi_modal_projector", ""),
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


class LlavaNextForConditionalGeneration(VisionLanguageModel):
    """LLaVA-NeXT (1.6): an image is a low-resolution view plus tiles of the grid that fits its aspect ratio best,
    each through the CLIP tower; the tiles' features are unpadded back to the image's shape with a learned newline
    closing each row, so an image's token count follows its size. Encoding is transformers' own
    (`LlavaNextModel.get_image_features`), on a `LlavaNextModel` whose language model is left out."""

    PREFIXES: ClassVar[tuple[tuple[str, str | None, str], ...]] = (
        *LANGUAGE_PREFIXES,
        ("model.", "vision", ""),  # after the language model's `model.language_model.`
        ("vision_tower.", "vision", "vision_tower."),
        ("multi_modal_projector.", "vision", "multi_modal_projector."),
        ("image_newline", "vision", "image_newline"),
    )

    def build_vision(self, config: PretrainedConfig) -> None:
        # transformers' model of the vision side, built around a one-layer, one-token stand-in for the language
        # model (which runs natively here), then without it.
        stand_in = copy.deepcopy(config)
        stand_in.text_config = type(config.text_config)(
            vocab_size=1, hidden_size=config.text_config.hidden_size, intermediate_size=1, num_hidden_layers=1,
            num_attention_heads=1, num_key_value_heads=1,
        )  # fmt: skip
        self.vision = LlavaNextModel(stand_in)
        self.vision.language_model = None

    @torch.no_grad()
    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        dtype, device = self._vision_dtype_device()
        tiles = [torch.from_numpy(image.data["pixel_values"]) for image in images]  # [tiles, 3, H, W] each
        padded = torch.nn.utils.rnn.pad_sequence(tiles, batch_first=True).to(device, dtype)  # [N, most tiles, ...]
        sizes = torch.from_numpy(np.stack([image.data["image_sizes"] for image in images])).to(device)
        # The feature layer and selection come from the config, as transformers' own forward pass takes them.
        features = self.vision.get_image_features(padded, sizes).pooler_output
        for image, feature in zip(images, features, strict=True):
            if feature.shape[0] != image.length:
                raise ValueError(f"an image encoded to {feature.shape[0]} embeddings for {image.length} tokens")
        return list(features)
