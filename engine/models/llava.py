"""LLaVA 1.5 and LLaVA-NeXT: a CLIP vision tower and a two-layer projector in front of a Llama-family language
model (engine/models/vision_language.py). In 1.5 an image is one size (the processor resizes and crops it), so a
step's images encode in one vision-tower call; in NeXT an image is tiled at a resolution that suits it.

Both read the tower's hidden states at `vision_feature_layer` (LLaVA-1.5: -2, the second to last), so the tower is
built with only the layers up to the deepest one read (`feature_depth`) and the checkpoint's later layers are left
unread: LLaVA-1.5-7B's CLIP runs 23 of its 24 layers, the same features for 1/24 less work."""

from __future__ import annotations

import copy
import re
from typing import ClassVar

import numpy as np
import torch
from transformers import AutoModel, PretrainedConfig
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector
from transformers.models.llava_next.modeling_llava_next import LlavaNextModel

from engine.models.vision_language import LANGUAGE_PREFIXES, VisionLanguageModel
from engine.multimodal.inputs import ImageInput

_TOWER_LAYER = re.compile(r"\.layers\.(\d+)\.")


def feature_depth(config: PretrainedConfig) -> tuple[list[int], PretrainedConfig]:
    """The feature layers as indices into the hidden states of a tower of only the layers they need (the embeddings
    at 0, layer i's output at i; `vision_feature_layer` may count from the end), and that tower's config."""
    layers = config.vision_feature_layer
    states = config.vision_config.num_hidden_layers + 1
    absolute = [layer % states for layer in ([layers] if isinstance(layers, int) else layers)]
    tower = copy.deepcopy(config.vision_config)
    tower.num_hidden_layers = max(absolute)
    return absolute, tower


def beyond_depth(name: str, depth: int) -> bool:
    """Whether the tower tensor `name` belongs to one of its layers past `depth` (left unread)."""
    match = _TOWER_LAYER.search(name)
    return match is not None and int(match.group(1)) >= depth


class LlavaForConditionalGeneration(VisionLanguageModel):
    PREFIXES: ClassVar[tuple[tuple[str, str | None, str], ...]] = (
        *LANGUAGE_PREFIXES,
        ("model.vision_tower.", "vision_tower", ""),
        ("model.multi_modal_projector.", "multi_modal_projector", ""),
        ("vision_tower.", "vision_tower", ""),
        ("multi_modal_projector.", "multi_modal_projector", ""),
    )

    def build_vision(self, config: PretrainedConfig) -> None:
        self.feature_layers, tower = feature_depth(config)
        self.vision_tower = AutoModel.from_config(tower)
        self.multi_modal_projector = LlavaMultiModalProjector(config)
        self.select_strategy = config.vision_feature_select_strategy

    def unread(self, part: str, name: str) -> bool:
        return beyond_depth(name, self.vision_tower.config.num_hidden_layers)

    @torch.no_grad()
    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        dtype, device = self._vision_dtype_device()
        pixels = torch.stack([torch.from_numpy(image.data["pixel_values"]) for image in images]).to(device, dtype)
        out = self.vision_tower(pixels, output_hidden_states=True)  # hidden_states: layers + 1 x [N, 1 + P, vh]
        selected = [out.hidden_states[layer] for layer in self.feature_layers]
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
        layers, stand_in.vision_config = feature_depth(config)
        stand_in.vision_feature_layer = layers[0] if isinstance(config.vision_feature_layer, int) else layers
        stand_in.text_config = type(config.text_config)(
            vocab_size=1, hidden_size=config.text_config.hidden_size, intermediate_size=1, num_hidden_layers=1,
            num_attention_heads=1, num_key_value_heads=1,
        )  # fmt: skip
        self.vision = LlavaNextModel(stand_in)
        self.vision.language_model = None

    def unread(self, part: str, name: str) -> bool:
        depth = self.vision.config.vision_config.num_hidden_layers
        return name.startswith("vision_tower.") and beyond_depth(name, depth)

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
