"""LLaVA (1.5): a CLIP vision tower and a two-layer projector in front of a Llama-family language model.

The language model is the native one (engine/models/llama.py), built from the config's `text_config`, and runs the
packed step as any text model does. The vision tower and the projector are transformers' own modules, run once per
distinct image (the runner's encoder cache), batched over the images a step encodes: they are a small share of a
request's work, and transformers' modules make them the model's own by construction. An image's embeddings
replace its placeholder tokens' embeddings in the packed row (`inputs_embeds`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import AutoModel, PretrainedConfig
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

from engine.attention.base import AttentionNeeds
from engine.attention.spec import CacheSpec
from engine.distributed.parallel import TensorParallel
from engine.layers.linear_method import LinearMethod
from engine.models.llama import LlamaFamilyForCausalLM
from engine.multimodal.inputs import ImageInput

_PREFIXES = (
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
"""Checkpoint name prefix -> (the part that loads it, the prefix that part knows it by)."""


class LlavaForConditionalGeneration(nn.Module):
    """The `CausalLM` of engine/models/base.py over the language model, plus `embed_input_ids` and
    `encode_images`, which the runner calls for steps with image tokens."""

    def __init__(
        self,
        config: PretrainedConfig,
        max_positions: int,
        language_model: LlamaFamilyForCausalLM,
        vision_tower: nn.Module,
        projector: nn.Module,
    ) -> None:
        super().__init__()
        self.config = config
        self.language_model = language_model
        self.vision_tower = vision_tower
        self.multi_modal_projector = projector
        self.num_layers = language_model.num_layers
        self.feature_layer = config.vision_feature_layer
        self.select_strategy = config.vision_feature_select_strategy
        self.image_token_id = config.image_token_id

    @classmethod
    def empty(
        cls,
        config: PretrainedConfig,
        max_positions: int,
        device: torch.device,
        dtype: torch.dtype,
        tp: TensorParallel | None = None,
        method: LinearMethod | None = None,
        head_method: LinearMethod | None = None,
    ) -> LlavaForConditionalGeneration:
        """The language model as `LlamaFamilyForCausalLM.empty` builds it; the vision tower and projector made
        in `dtype` on `device` (their non-persistent buffers, CLIP's position ids, are computed, not loaded)."""
        language_model = LlamaFamilyForCausalLM.empty(
            config.text_config, max_positions, device, dtype, tp, method, head_method
        )
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                vision_tower = AutoModel.from_config(config.vision_config)
                projector = LlavaMultiModalProjector(config)
        finally:
            torch.set_default_dtype(default)
        return cls(config, max_positions, language_model, vision_tower, projector)

    # -- the language model --------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.language_model(input_ids, positions, kv_caches, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.language_model.compute_logits(hidden)

    def cache_specs(self) -> list[CacheSpec]:
        return self.language_model.cache_specs()

    def attention_needs(self) -> AttentionNeeds:
        return self.language_model.attention_needs()

    def fuse_decoder(self) -> None:
        self.language_model.fuse_decoder()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]: the token embeddings that image embeddings are placed among."""
        return self.language_model.model.embed_tokens(input_ids)

    # -- the images ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Each image's embeddings `[length, hidden]` (in the language model's dtype), one vision-tower call for
        all of them (LLaVA-1.5's images are all one size)."""
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        device = self.multi_modal_projector.linear_1.weight.device
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

    # -- weights ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The language model's tensors to its own loader (renamed to a text checkpoint's names); the vision
        tower's and the projector's copied into their parameters, every one of which must be present."""
        vision: dict[str, torch.Tensor] = {}
        self.language_model.load_weights(self._route(weights, vision))
        for part in ("vision_tower", "multi_modal_projector"):
            module: nn.Module = getattr(self, part)
            state = {name[len(part) + 1 :]: t for name, t in vision.items() if name.startswith(part + ".")}
            missing, unexpected = module.load_state_dict(state, strict=False)
            if unexpected:
                raise ValueError(f"checkpoint tensors with no place in LLaVA's {part}: {sorted(unexpected)[:5]}")
            if missing:
                raise ValueError(f"checkpoint lacks tensors of LLaVA's {part}: {sorted(missing)[:5]}")

    @staticmethod
    def _route(
        weights: Iterable[tuple[str, torch.Tensor]], vision: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The language model's tensors, renamed; the others kept in `vision` under `part.name`."""
        for name, tensor in weights:
            for prefix, part, renamed in _PREFIXES:
                if name.startswith(prefix):
                    rest = renamed + name[len(prefix) :]
                    if part == "language_model":
                        yield rest, tensor
                    else:
                        vision[f"{part}.{rest}"] = tensor
                    break
            else:
                raise ValueError(f"checkpoint tensor {name!r} has no place in LLaVA")
