"""Native state-space language models: Mamba, Falcon-Mamba (Mamba, its time step, B and C normalised) and Mamba2
(every layer a state-space mixer, no attention), and the base that the hybrids beside them build on
(engine/models/hybrid.py: Jamba, Granite 4).

A recurrent layer's cache is its state, not pages: its `cache_specs` entry is a `RecurrentStateSpec`, which the
engine allocates as slots (engine/execution/kv_caches.py) and the scheduler hands out one per running request
(engine/core/state_slots.py). Steps run eagerly: a mixer reads the step's slots from the step context, and its
scan branches on the step's shape (decodes, prompt chunks). Tensor parallelism, LoRA, speculative decoding and
`--compile` are refused for these models at start-up, by name (engine/models/loader.py's checks).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from engine.attention.base import AttentionNeeds
from engine.attention.spec import CacheSpec
from engine.config import EngineStartupError
from engine.distributed.parallel import TensorParallel
from engine.layers.linear import LinearBase
from engine.layers.linear_method import LinearMethod, UnquantizedLinearMethod
from engine.layers.mamba import Mamba2Mixer, MambaMixer
from engine.layers.norm import RMSNorm
from engine.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from engine.models.base import built_empty
from engine.models.llama import EXPERT_NAME, check_all_loaded, load_expert, plain_parameters

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class RecurrentCausalLM(nn.Module):
    """What the state-space models share: the `empty` constructor the loader calls, the LM head, each layer's
    cache spec from its mixer, and loading by checkpoint name (`_place` renames a family's names to its modules')."""

    embedding_name: ClassVar[str]
    """Where the embedding sits (`backbone.embeddings`, `model.embed_tokens`): what a tied head shares."""

    def __init__(
        self,
        config: PretrainedConfig,
        max_positions: int,
        tp: TensorParallel | None = None,
        method: LinearMethod | None = None,
        head_method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        if tp is not None:
            raise EngineStartupError(
                f"tensor parallelism for {config.model_type!r}: its state-space layers run on one device here"
            )
        self.config = config
        self.tp = None
        self.max_positions = max_positions
        self.num_layers = config.num_hidden_layers
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.dtype = torch.get_default_dtype()
        """The model's dtype (`empty` builds it under that default): its convolution states'."""
        method = method or UnquantizedLinearMethod()
        self.build(config, method)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, method=head_method or method,
                                      tied=self.tied)  # fmt: skip
        self.vocab_per_rank = self.lm_head.output_size
        if self.tied:
            self.lm_head.tie_to(self.embedding)

    def build(self, config: PretrainedConfig, method: LinearMethod) -> None:
        """Make the family's modules, named as its checkpoint names them."""
        raise NotImplementedError

    @property
    def embedding(self) -> VocabParallelEmbedding:
        return self.get_submodule(self.embedding_name)  # type: ignore[return-value]

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
    ) -> RecurrentCausalLM:
        """The model with uninitialised parameters of `dtype` on `device` (`built_empty`), then `fill_computed` for
        what is computed rather than loaded."""
        model = built_empty(lambda: cls(config, max_positions, tp, method, head_method), device, dtype)
        if model.tied:
            model.lm_head.tie_to(model.embedding)
        with torch.device(device):
            model.fill_computed(dtype)
        return model

    def fill_computed(self, dtype: torch.dtype) -> None:
        """Buffers computed rather than loaded (a hybrid's rotary tables); none here."""

    def fuse_decoder(self) -> None:
        """The fused C++ decoder is the Llama family's: these layers run as modules."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden).float()

    def mixers(self) -> list[nn.Module]:
        """Each layer's mixer: a state-space one, or attention (a hybrid's)."""
        raise NotImplementedError

    def cache_specs(self) -> list[CacheSpec]:
        return [mixer.cache_spec(self.dtype) for mixer in self.mixers()]  # type: ignore[operator]

    def attention_needs(self) -> AttentionNeeds:
        return AttentionNeeds(frozenset())

    def _place(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor, object]]:
        """A checkpoint tensor -> (module parameter name, tensor, shard id) pieces; by default itself."""
        return [(name, tensor, None)]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Each checkpoint tensor, renamed by `_place`, to the module that holds it: as the Llama family loads
        (engine/models/llama.py's helpers), experts included."""
        modules = dict(self.named_modules())
        plain = plain_parameters(self, modules, (LinearBase,))
        loaded: set[str] = set()
        for checkpoint_name, checkpoint_tensor in weights:
            if self.tied and checkpoint_name == "lm_head.weight":
                continue
            for name, tensor, shard_id in self._place(checkpoint_name, checkpoint_tensor):
                if (expert := EXPERT_NAME.match(name)) is not None:
                    load_expert(modules, expert, tensor)
                    continue
                module_name, _, param_name = name.rpartition(".")
                module = modules.get(module_name)
                if isinstance(module, LinearBase | VocabParallelEmbedding):
                    module.weight_loader(param_name, tensor, shard_id)  # type: ignore[arg-type]
                elif name in plain:
                    self.get_parameter(name).copy_(tensor.view_as(self.get_parameter(name)))
                else:
                    raise ValueError(f"checkpoint tensor {checkpoint_name!r} has no place in the native "
                                     f"{self.config.model_type}")  # fmt: skip
                loaded.add(name)
        check_all_loaded(modules, plain, loaded, (LinearBase,))


class MambaBlock(nn.Module):
    def __init__(self, norm: RMSNorm, mixer: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.mixer = mixer

    def forward(self, hidden: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # The residual stream in float32 where the config says so (`residual_in_fp32`, the default): a block's
        # input is cast to the norm's dtype, its output added to the float32 residual.
        return hidden + self.mixer(self.norm(hidden.to(self.norm.weight.dtype)), cache)


def mamba_mixer(config: PretrainedConfig, method: LinearMethod) -> MambaMixer:
    """Mamba's; Falcon-Mamba's normalises its time step, B and C (no weights) before the scan."""
    falcon = config.model_type == "falcon_mamba"
    return MambaMixer(
        config.hidden_size, config.intermediate_size, config.state_size, config.conv_kernel,
        int(config.time_step_rank), conv_bias=config.use_conv_bias, proj_bias=config.use_bias, method=method,
        inner_norms_eps=config.mixer_rms_eps if falcon else None, weighted_norms=False,
    )  # fmt: skip


def mamba2_mixer(config: PretrainedConfig, method: LinearMethod) -> Mamba2Mixer:
    width = int(config.expand * config.hidden_size)
    return Mamba2Mixer(
        config.hidden_size, width, config.num_heads, config.head_dim, config.n_groups, config.state_size,
        config.conv_kernel, conv_bias=config.use_conv_bias, proj_bias=config.use_bias,
        eps=config.layer_norm_epsilon, time_step_limit=tuple(config.time_step_limit), method=method,
    )  # fmt: skip


class MambaForCausalLM(RecurrentCausalLM):
    """Mamba, Falcon-Mamba and Mamba2 (by model type, their mixers): embeddings, blocks of RMSNorm and mixer, a
    final norm."""

    embedding_name = "backbone.embeddings"

    def build(self, config: PretrainedConfig, method: LinearMethod) -> None:
        make = mamba2_mixer if config.model_type == "mamba2" else mamba_mixer
        self.backbone = nn.Module()
        self.backbone.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.backbone.layers = nn.ModuleList(
            MambaBlock(RMSNorm(config.hidden_size, config.layer_norm_epsilon), make(config, method))
            for _ in range(config.num_hidden_layers)
        )
        self.backbone.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.residual_dtype = torch.float32 if config.residual_in_fp32 else None

    def mixers(self) -> list[nn.Module]:
        return [block.mixer for block in self.backbone.layers]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`[T]` token ids -> final hidden states `[T, hidden]`; positions are unused (the state carries order)."""
        hidden = self.backbone.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        dtype = hidden.dtype
        if self.residual_dtype is not None:
            hidden = hidden.to(self.residual_dtype)
        for block, cache in zip(self.backbone.layers, kv_caches, strict=True):
            hidden = block(hidden, cache)
        return self.backbone.norm_f(hidden.to(dtype))
