"""What every image model shares: a vision encoder in front of a language model.

The language model is the native Llama-family one (engine/models/llama.py), built from the config's `text_config`,
or for a family whose language model has no native modules (Gemma 3) transformers' own through the adapter
(engine/models/hf_adapter.py); it runs the packed step as any text model does. The vision encoder (and its
projector) are transformers' own modules, run once per distinct image (the runner's encoder cache), batched over
the images a step encodes: they are a small share of a request's work, and transformers' modules make them the
model's own by construction. An image's embeddings replace its placeholder tokens' embeddings in the packed row
(`inputs_embeds`).

A family (engine/models/llava.py, qwen2_vl.py, gemma3.py) says which modules its vision side has, how the
checkpoint names them (`PREFIXES`) and how images encode (`encode_images`); a family with positions of several
axes (Qwen2-VL's M-RoPE) says where each prompt token sits (`rope_positions`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch
from torch import nn

from engine.attention.base import AttentionNeeds
from engine.attention.spec import CacheSpec
from engine.distributed.parallel import TensorParallel
from engine.layers.activation import QuickGELU
from engine.layers.linear import PatchLinear, adopt_linears
from engine.layers.linear_method import LinearMethod
from engine.models.llama import LlamaFamilyForCausalLM
from engine.multimodal.inputs import ImageInput

if TYPE_CHECKING:
    from transformers import PretrainedConfig


LANGUAGE_PREFIXES: tuple[tuple[str, str | None, str], ...] = (
    # transformers 5's layout, then the layout of checkpoints saved before it (llava-hf's on the Hub).
    ("model.language_model.", "language_model", "model."),
    ("lm_head.", "language_model", "lm_head."),
    ("language_model.model.", "language_model", "model."),
    ("language_model.lm_head.", "language_model", "lm_head."),
)
"""Where image models' checkpoints keep their language model, for `VisionLanguageModel.PREFIXES`."""


class VisionLanguageModel(nn.Module):
    """The `CausalLM` of engine/models/base.py over the language model, plus `embed_input_ids`, `encode_images`
    and `rope_positions`, which the runner calls for prompts with images."""

    PREFIXES: ClassVar[tuple[tuple[str, str | None, str], ...]] = ()
    """Checkpoint name prefix -> (the part that loads it: `language_model`, a vision module's attribute name, or
    None for tensors left unread; the prefix that part knows it by), first match wins."""

    bidirectional_images: ClassVar[bool] = False
    """Whether an image's tokens attend to each other in both directions (Gemma 3): the engine gives each image's
    tokens a non-causal span, which chunked prefill never splits."""

    def __init__(self, config: PretrainedConfig, language_model: nn.Module) -> None:
        """`language_model`: a `CausalLM` (engine/models/base.py) of `config.text_config`."""
        super().__init__()
        self.config = config
        self.language_model = language_model
        self.num_layers = language_model.num_layers

    def build_vision(self, config: PretrainedConfig) -> None:
        """Make the vision modules as attributes (in the default dtype, on the default device)."""
        raise NotImplementedError

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
    ) -> VisionLanguageModel:
        """The language model as `LlamaFamilyForCausalLM.empty` builds it; the vision modules made in `dtype` on
        `device` (their non-persistent buffers, such as position ids, are computed, not loaded)."""
        language_model = LlamaFamilyForCausalLM.empty(
            config.text_config, max_positions, device, dtype, tp, method, head_method
        )
        model = cls(config, language_model)
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model.build_vision(config)
        finally:
            torch.set_default_dtype(default)
        return model

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
        return self.language_model.model.embed_tokens(input_ids)  # the native language model's

    # -- the images ----------------------------------------------------------------------------------------

    @property
    def rope_axes(self) -> int:
        """Rotary position axes: 1, or 3 for M-RoPE (time, height, width), whose positions `rope_positions`
        gives."""
        return 1

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Each image's embeddings `[length, hidden]`, in the language model's dtype."""
        raise NotImplementedError

    def rope_positions(self, num_prompt_tokens: int, images: tuple[ImageInput, ...]) -> tuple[np.ndarray, int] | None:
        """For a model of several rotary axes: each prompt token's position on every axis `[axes, prompt]`, and
        the offset of the positions after the prompt (position p sits at p + offset on every axis). None: the
        token's own position on every axis."""
        return None

    def adopt_vision_layers(self, method: LinearMethod) -> None:
        """Once the weights are in: the vision modules' linears onto `method` (the language model's: on a CPU the
        kernels' packed layouts), a patch embedding that is a convolution of one patch per input onto a matmul
        (`PatchLinear`), and QuickGELU onto the kernels' one pass. The vision side then runs as the language
        model's layers do; its maths is the same."""
        # Imported here: transformers.activations imports its model-loading machinery (~0.6 s), which a text model's
        # start (this module is the loader's) would pay for nothing; an image model has imported it by now.
        from transformers.activations import QuickGELUActivation

        for name, module in self.named_children():
            if name == "language_model":
                continue
            adopt_linears(module, method)
            swaps = [(parent, child_name, child) for parent in module.modules()
                     for child_name, child in parent.named_children()]  # fmt: skip
            for parent, child_name, child in swaps:
                if PatchLinear.adopts(child):
                    setattr(parent, child_name, PatchLinear(child))
                elif type(child) is QuickGELUActivation:
                    setattr(parent, child_name, QuickGELU())

    def unread(self, part: str, name: str) -> bool:
        """Whether checkpoint tensor `name` of vision module `part` (as the module names it) is left unread: one the
        family's features never depend on, such as a vision tower's layers past the one its features are read at."""
        return False

    def _vision_dtype_device(self) -> tuple[torch.dtype, torch.device]:
        param = next(p for name, p in self.named_parameters() if not name.startswith("language_model."))
        return param.dtype, param.device

    # -- weights ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The language model's tensors to its own loader (renamed to a text checkpoint's names); the vision
        modules' copied into their parameters, every one of which must be present."""
        vision: dict[str, torch.Tensor] = {}
        self.language_model.load_weights(self._route(weights, vision))
        for part in sorted({part for _, part, _ in self.PREFIXES if part not in ("language_model", None)}):
            module: nn.Module = getattr(self, part)
            state = {name[len(part) + 1 :]: t for name, t in vision.items() if name.startswith(part + ".")}
            state = {name: tensor for name, tensor in state.items() if not self.unread(part, name)}
            missing, unexpected = module.load_state_dict(state, strict=False)
            kind = type(self).__name__
            if unexpected:
                raise ValueError(f"checkpoint tensors with no place in {kind}'s {part}: {sorted(unexpected)[:5]}")
            if missing:
                raise ValueError(f"checkpoint lacks tensors of {kind}'s {part}: {sorted(missing)[:5]}")

    def _route(
        self, weights: Iterable[tuple[str, torch.Tensor]], vision: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The language model's tensors, renamed; the others kept in `vision` under `part.name`."""
        for name, tensor in weights:
            for prefix, part, renamed in self.PREFIXES:
                if name.startswith(prefix):
                    rest = renamed + name[len(prefix) :]
                    if part == "language_model":
                        yield rest, tensor
                    elif part is not None:
                        vision[f"{part}.{rest}"] = tensor
                    break
            else:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")


class LanguageModelAlone(VisionLanguageModel):
    """An image model of a family Ferry has no vision side for, served text-only as its operator asked
    (--limit-mm-per-prompt image=0): its language model alone; the checkpoint's vision tensors are left unread,
    and a request with an image is refused (engine/core/engine_core.py)."""

    PREFIXES: ClassVar[tuple[tuple[str, str | None, str], ...]] = (*LANGUAGE_PREFIXES, ("", None, ""))

    def build_vision(self, config: PretrainedConfig) -> None:
        """No vision side."""
