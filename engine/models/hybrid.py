"""Hybrid models: attention layers (paged, as the Llama family's) interleaved with state-space ones (slots).

Bamba: Mamba2 mixers and attention (half its head dimensions rotary) by `attn_layer_indices`, each followed by a
dense SiLU-gated MLP.

Jamba: Mamba mixers with RMSNorms on the time step, B and C, an attention layer every `attn_layer_period` (no
rotary positions), a mixture of experts every `expert_layer_period` (softmax top-k, not renormalised), a dense
SiLU-gated MLP elsewhere. Granite 4's hybrids (`granitemoehybrid`): Mamba2 mixers and attention by `layer_types`
(rotary only where `position_embedding_type` is "rope"; scores scaled by `attention_multiplier`), each layer's
feed-forward a shared MLP plus, with experts, a top-k-softmax mixture; the embedding, each residual branch and the
logits scaled by the config's multipliers.

The attention layers' caches are pages and their step metadata the step context's, as for any model; the
state-space layers' are slots (engine/models/state_space.py). Prefix caching is off for these models (a page's K
and V say nothing of the state at its end): the engine logs it at start-up.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.bamba.modeling_bamba import BambaRotaryEmbedding

from engine.attention.base import AttentionFeature, AttentionNeeds
from engine.attention.spec import CacheSpec
from engine.layers.linear_method import LinearMethod
from engine.layers.mamba import Mamba2Mixer, MambaMixer
from engine.layers.moe import FusedExperts, Routing
from engine.layers.norm import RMSNorm
from engine.layers.rotary import LlamaRotary, rotary_tables
from engine.layers.vocab import VocabParallelEmbedding
from engine.models.llama import EXPERT_NAME, MLP, Attention, LlamaFamilyForCausalLM, attention_spec
from engine.models.state_space import RecurrentCausalLM


class RoutedExperts(nn.Module):
    """A router (plain matrix in the model's dtype: it picks experts) over SiLU-gated experts."""

    def __init__(self, config: PretrainedConfig, num_experts: int, width: int, routing: Routing) -> None:
        super().__init__()
        self.router = nn.Linear(config.hidden_size, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, config.hidden_size, width)
        self.routing = routing

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        weights, ids = self.routing.select(self.router(x).float())
        return self.experts(x, weights.to(x.dtype).float(), ids)


class HybridLayer(nn.Module):
    """Norm, mixer (attention or state-space), residual; norm, feed-forward, residual; each branch times
    `residual_multiplier` (Granite's; 1 for Jamba)."""

    def __init__(self, mixer_name: str, mixer: nn.Module, norm_names: tuple[str, str], eps: float, hidden: int,
                 residual_multiplier: float) -> None:  # fmt: skip
        super().__init__()
        self.mixer_name = mixer_name
        self.add_module(mixer_name, mixer)
        self.norm_names = norm_names
        for name in norm_names:
            self.add_module(name, RMSNorm(hidden, eps))
        self.residual_multiplier = residual_multiplier

    @property
    def mixer(self) -> nn.Module:
        return self.get_submodule(self.mixer_name)

    def feed_forward_of(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's feed-forward (`feed_forward`, a dense MLP or a mixture of experts); Granite's sums two."""
        return self.feed_forward(x)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        before, after = (self.get_submodule(name) for name in self.norm_names)
        mixer = self.mixer
        normed = before(hidden)
        mixed = mixer(normed, cos, sin, cache) if isinstance(mixer, Attention) else mixer(normed, cache)
        hidden = hidden + mixed * self.residual_multiplier if self.residual_multiplier != 1 else hidden + mixed
        out = self.feed_forward_of(after(hidden))
        return hidden + out * self.residual_multiplier if self.residual_multiplier != 1 else hidden + out


class JambaLayer(HybridLayer):
    def __init__(self, config: PretrainedConfig, layer: int, method: LinearMethod) -> None:
        if config.layers_block_type[layer] == "attention":
            name, mixer = "self_attn", Attention(config, layer, method, None)
        else:
            name = "mamba"
            mixer = MambaMixer(
                config.hidden_size, config.mamba_expand * config.hidden_size, config.mamba_d_state,
                config.mamba_d_conv, config.mamba_dt_rank, conv_bias=config.mamba_conv_bias,
                proj_bias=config.mamba_proj_bias, method=method, inner_norms_eps=config.rms_norm_eps,
            )  # fmt: skip
        super().__init__(name, mixer, ("input_layernorm", "pre_ff_layernorm"), config.rms_norm_eps,
                         config.hidden_size, 1.0)  # fmt: skip
        experts = config.layers_num_experts[layer]
        self.feed_forward: nn.Module = (
            RoutedExperts(config, experts, config.intermediate_size, Routing(config.num_experts_per_tok, False))
            if experts > 1
            else MLP(config, method, None)
        )


def _mamba2_mixer(config: PretrainedConfig, method: LinearMethod) -> Mamba2Mixer:
    """The Mamba2 mixer of a hybrid's config (`mamba_*` options: Granite 4's, Bamba's)."""
    return Mamba2Mixer(
        config.hidden_size, int(config.mamba_expand * config.hidden_size), config.mamba_n_heads,
        config.mamba_d_head, config.mamba_n_groups, config.mamba_d_state, config.mamba_d_conv,
        conv_bias=config.mamba_conv_bias, proj_bias=config.mamba_proj_bias, eps=config.rms_norm_eps,
        time_step_limit=tuple(config.time_step_limit or (0.0, float("inf"))), method=method,
    )  # fmt: skip


class BambaLayer(HybridLayer):
    """Bamba: Mamba2 or attention (partial rotary), then a dense SiLU-gated MLP, Jamba's norm names."""

    def __init__(self, config: PretrainedConfig, layer: int, method: LinearMethod) -> None:
        if config.layers_block_type[layer] == "full_attention":
            name, mixer = "self_attn", Attention(config, layer, method, None)
        else:
            name, mixer = "mamba", _mamba2_mixer(config, method)
        super().__init__(name, mixer, ("input_layernorm", "pre_ff_layernorm"), config.rms_norm_eps,
                         config.hidden_size, 1.0)  # fmt: skip
        self.feed_forward = MLP(config, method, None)


class GraniteHybridLayer(HybridLayer):
    def __init__(self, config: PretrainedConfig, layer: int, method: LinearMethod) -> None:
        if config.layers_block_type[layer] in ("linear_attention", "mamba"):
            name, mixer = "mamba", _mamba2_mixer(config, method)
        else:
            name, mixer = "self_attn", Attention(config, layer, method, None)
        super().__init__(name, mixer, ("input_layernorm", "post_attention_layernorm"), config.rms_norm_eps,
                         config.hidden_size, config.residual_multiplier)  # fmt: skip
        self.shared_mlp = MLP(config, method, None, width=config.shared_intermediate_size)
        self.block_sparse_moe = (
            RoutedExperts(config, config.num_local_experts, config.intermediate_size,
                          Routing(config.num_experts_per_tok, False, softmax_of_top_k=True))
            if config.num_local_experts > 0
            else None
        )  # fmt: skip

    def feed_forward_of(self, x: torch.Tensor) -> torch.Tensor:
        if self.block_sparse_moe is None:
            return self.shared_mlp(x)
        return self.block_sparse_moe(x) + self.shared_mlp(x)


class HybridCausalLM(RecurrentCausalLM):
    """`model.embed_tokens`, the layers, a final norm (`final_norm_name`), the LM head."""

    embedding_name = "model.embed_tokens"
    layer_class: type[HybridLayer]
    final_norm_name: str
    rotary_module: Callable[[PretrainedConfig], nn.Module] = LlamaRotary
    """The module the rotary tables are computed by (transformers' own for a family that rotates part of a head)."""

    def build(self, config: PretrainedConfig, method: LinearMethod) -> None:
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(self.layer_class(config, i, method) for i in range(config.num_hidden_layers))
        self.model.add_module(self.final_norm_name, RMSNorm(config.hidden_size, config.rms_norm_eps))
        self.rotary = any(isinstance(m, Attention) and m.rotary for m in self.mixers())
        self.embedding_multiplier = float(getattr(config, "embedding_multiplier", 1.0) or 1.0)
        self.logits_scaling = float(getattr(config, "logits_scaling", 1.0) or 1.0)

    def fill_computed(self, dtype: torch.dtype) -> None:
        if self.rotary:
            self.cos_cache, self.sin_cache = rotary_tables(self.config, self.max_positions, dtype, self.rotary_module)

    def mixers(self) -> list[nn.Module]:
        return [layer.mixer for layer in self.model.layers]

    def cache_specs(self) -> list[CacheSpec]:
        dtype = self.dtype
        return [
            attention_spec(mixer, dtype) if isinstance(mixer, Attention) else mixer.cache_spec(dtype)  # type: ignore[operator]
            for mixer in self.mixers()
        ]

    def attention_needs(self) -> AttentionNeeds:
        """A sliding window where an attention layer has one (the paged backends compute the rest as causal)."""
        windowed = any(isinstance(m, Attention) and m.sliding_window is not None for m in self.mixers())
        return AttentionNeeds(frozenset({AttentionFeature.SLIDING_WINDOW} if windowed else ()))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden).float()
        return logits if self.logits_scaling == 1 else logits / self.logits_scaling

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.embedding_multiplier != 1:
            hidden = hidden * self.embedding_multiplier
        cos = sin = None
        if self.rotary:
            cos, sin = self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)
        for layer, cache in zip(self.model.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, cache)
        return self.model.get_submodule(self.final_norm_name)(hidden)

    def _place(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor, object]]:
        """The attention's and MLP's projections into their fused modules, as the Llama family names them (experts
        are loaded by their names, which are Qwen's already)."""
        if EXPERT_NAME.match(name) is None:
            for part, (fused, shard_id) in LlamaFamilyForCausalLM.fused_names.items():
                if part in name:
                    return [(name.replace(part, fused), tensor, shard_id)]
        return [(name, tensor, None)]


class JambaForCausalLM(HybridCausalLM):
    layer_class = JambaLayer
    final_norm_name = "final_layernorm"


class BambaForCausalLM(HybridCausalLM):
    layer_class = BambaLayer
    final_norm_name = "final_layernorm"
    rotary_module = BambaRotaryEmbedding  # `partial_rotary_factor`: half the head's dimensions


class GraniteMoeHybridForCausalLM(HybridCausalLM):
    layer_class = GraniteHybridLayer
    final_norm_name = "norm"

    def _place(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor, object]]:
        name = name.replace(".block_sparse_moe.router.layer.", ".block_sparse_moe.router.")
        if name.endswith(".shared_mlp.input_linear.weight"):  # [2 * width, hidden]: gate rows, then up rows
            gate, up = tensor.chunk(2, dim=0)
            fused = name.replace(".input_linear.", ".gate_up_proj.")
            return [(fused, gate, 0), (fused, up, 1)]
        if name.endswith(".shared_mlp.output_linear.weight"):
            return [(name.replace(".output_linear.", ".down_proj."), tensor, None)]
        if name.endswith(".block_sparse_moe.input_linear.weight"):  # [experts, 2 * width, hidden]: stacked gate/up
            return [(name.replace(".input_linear.weight", ".experts.gate_up_proj"), tensor, None)]
        if name.endswith(".block_sparse_moe.output_linear.weight"):
            return [(name.replace(".output_linear.weight", ".experts.down_proj"), tensor, None)]
        return super()._place(name, tensor)
