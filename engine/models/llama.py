"""Native Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) and its mixture-of-experts variants (Mixtral,
Qwen2-MoE, Qwen3-MoE: the same attention, a sparse feed-forward in some or all layers): the fast path.

Differences from the transformers modules are for speed only: fused QKV and gate/up projections, rotary cos/sin
precomputed once for every position, the packed `[T, ...]` layout with no batch dimension, attention through a
paged backend, and no mask building per step. The maths (and so greedy output) is the same.

The decoder (`Backbone.forward`, and each `DecoderLayer`) takes and returns tensors only: a layer's attention
finds the step's metadata in the step context (`engine/attention/context.py`), so `engine/execution/compile.py` can
compile a layer, or the whole decoder, into a graph that does not change from step to step.

With tensor parallelism (`tp`) each rank builds its shard, Megatron-style: QKV and gate/up are column-parallel
(this rank's attention heads, KV heads and MLP columns), o and down row-parallel with one all-reduce each, the
embedding and the LM head vocab-parallel (the logits of the sampling rows are gathered on rank 0 only). With fewer
KV heads than ranks each KV head is replicated on the ranks whose query heads read it. A sparse layer's router is
replicated and each expert split like the MLP (engine/layers/moe.py), one all-reduce for its experts and its shared
expert together.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionFeature, AttentionNeeds
from engine.attention.graph_op import paged_attention
from engine.attention.spec import CacheSpec, FullAttentionSpec, SlidingWindowSpec
from engine.config import EngineStartupError
from engine.distributed.parallel import TensorParallel
from engine.kernels.library import cpu_kernels_take
from engine.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    Shard,
    ShardId,
)
from engine.layers.linear_method import LinearMethod, UnquantizedLinearMethod
from engine.layers.moe import ClampedSwigluExperts, FusedExperts, Routing
from engine.layers.norm import RMSNorm
from engine.layers.rotary import apply_rotary, rotary_tables
from engine.layers.sparse_layers import is_sparse, is_sparse_layer
from engine.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from engine.models.base import built_empty
from engine.models.llama_fused import FusedDecoder
from engine.quantization import UnsupportedQuantization
from engine.quantization.base import QuantizedLinearMethod

if TYPE_CHECKING:
    from transformers import PretrainedConfig


# transformers checkpoint name -> (Ferry module name, shard id)
_FUSED: dict[str, tuple[str, ShardId]] = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}

EXPERT_NAME = re.compile(
    r"^(?P<layer>.+)\.experts\.(?:(?P<expert>\d+)\.(?P<part>\w+)\.weight|(?P<stacked>gate_up_proj|down_proj))$"
)
"""An expert's matrix (`...mlp.experts.3.gate_proj.weight`), or all experts' stacked (transformers 5's
`...mlp.experts.gate_up_proj`), once a family's names are Qwen's (Mixtral's `_MIXTRAL_NAMES`; the hybrids' in
engine/models/hybrid.py), under whatever block holds the experts (`mlp`, Jamba's `feed_forward`)."""

_EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_MIXTRAL_NAMES = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


def sliding_window_of_layer(config: PretrainedConfig, layer: int) -> int | None:
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if layer_types is not None:
        return window if layer_types[layer] == "sliding_attention" else None
    return window


def check_tensor_parallel(config: PretrainedConfig, size: int) -> None:
    """Raise EngineStartupError, saying why, when `config`'s model cannot be split over `size` ranks exactly."""
    heads, kv_heads, width = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    problems = []
    if heads % size:
        problems.append(f"its {heads} attention heads do not divide by {size}")
    if kv_heads % size and size % kv_heads:
        problems.append(f"its {kv_heads} KV heads neither divide by {size} nor divide {size} (for replication)")
    if width % size:
        problems.append(f"its MLP width {width} does not divide by {size}")
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        expert_width = getattr(config, name, None)
        if is_sparse(config) and expert_width and expert_width % size:
            problems.append(f"its {name} {expert_width} does not divide by {size}")
    if problems:
        raise EngineStartupError(
            f"this {config.model_type} model cannot be split over --tensor-parallel-size {size}: " + "; ".join(problems)
        )


def _shard(tp: TensorParallel | None) -> Shard:
    return Shard() if tp is None else Shard(tp.rank, tp.size)


def _all_reduce(tp: TensorParallel | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    return None if tp is None else tp.all_reduce


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer: int, method: LinearMethod, tp: TensorParallel | None) -> None:
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if config.model_type in ("qwen2", "qwen2_moe", "qwen2_vl_text", "qwen2_5_vl_text"):
            qkv_bias, out_bias = getattr(config, "qkv_bias", True), False
        else:
            qkv_bias = out_bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads,
            bias=qkv_bias, method=method, shard=_shard(tp),
        )  # fmt: skip
        # This rank's heads; a KV head shared by more ranks than there are KV heads is replicated on each.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=out_bias, method=method,
            shard=_shard(tp), all_reduce=_all_reduce(tp),
        )  # fmt: skip
        self.qk_norm = config.model_type in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        # Granite 4's hybrids scale scores by a multiplier of their own; they and Jamba may have no rotary positions
        # at all (their state-space layers carry order).
        self.scale = getattr(config, "attention_multiplier", None) or self.head_dim**-0.5
        self.rotary = config.model_type != "jamba" and getattr(config, "position_embedding_type", "rope") == "rope"
        self.sliding_window = sliding_window_of_layer(config, layer)
        self.layer = layer
        # gpt-oss: a learned logit per head in the softmax's denominator (this rank's heads).
        self.sinks = (
            nn.Parameter(torch.empty(self.num_heads), requires_grad=False) if config.model_type == "gpt_oss" else None
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary and cos.shape[-1] < self.head_dim:
            # Partial rotary (Bamba's half): the first rotary_dim dimensions turn, the rest pass as they are.
            turned = cos.shape[-1]
            q = torch.cat([apply_rotary(q[..., :turned], cos, sin), q[..., turned:]], dim=-1)
            k = torch.cat([apply_rotary(k[..., :turned], cos, sin), k[..., turned:]], dim=-1)
        elif self.rotary:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        sinks = None if self.sinks is None else self.sinks.float()  # the backends read float32 logits
        out = paged_attention(q, k, v, kv_cache, self.scale, self.sliding_window, sinks)
        return self.o_proj(out.reshape(tokens, self.q_size))


FUSED_SILU_MAX_TOKENS = 16
"""Up to this many tokens (decode) SiLU-and-multiply is one kernel call; a larger step keeps torch's vectorised SiLU,
which the kernel's scalar exp does not match on thousands of rows."""


class MLP(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        method: LinearMethod,
        tp: TensorParallel | None,
        width: int | None = None,
        reduce: bool = True,
    ) -> None:
        """`width`: the intermediate size (the config's by default); `reduce=False` leaves the partial sums of
        tensor-parallel ranks for the caller to all-reduce (a shared expert's, with the routed experts')."""
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        width = width or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [width, width], bias=bias, method=method, shard=_shard(tp)
        )
        self.intermediate = self.gate_up_proj.part_sizes[0]
        self.down_proj = RowParallelLinear(
            width, config.hidden_size, bias=bias, method=method, shard=_shard(tp),
            all_reduce=_all_reduce(tp) if reduce else None,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        # Not inside a compiled graph: a branch on the token count would be one more graph to compile per side.
        fused = not torch.compiler.is_compiling() and gate_up.shape[0] <= FUSED_SILU_MAX_TOKENS
        if fused and cpu_kernels_take(gate_up):
            return self.down_proj(torch.ops.ferry_kernels.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoeBlock(nn.Module):
    """A router over `num_experts` experts, `top_k` of them per token (engine/layers/moe.py): SiLU-gated (Mixtral,
    Qwen), or gpt-oss's biased, clamped SwiGLU behind a biased router; Qwen2-MoE adds a shared expert, gated per token
    by a sigmoid, to every token's mix."""

    def __init__(self, config: PretrainedConfig, method: LinearMethod, tp: TensorParallel | None) -> None:
        super().__init__()
        family = config.model_type
        num_experts = config.num_local_experts if family in ("mixtral", "gpt_oss") else config.num_experts
        width = config.intermediate_size if family in ("mixtral", "gpt_oss") else config.moe_intermediate_size
        self.routing = Routing(
            config.num_experts_per_tok,
            family == "mixtral" or bool(getattr(config, "norm_topk_prob", False)),
            softmax_of_top_k=family == "gpt_oss",
        )
        # Router and shared-expert gate stay plain matrices in the model's dtype: their outputs pick experts, which
        # a quantized router's rounding could change.
        self.gate = nn.Linear(config.hidden_size, num_experts, bias=family == "gpt_oss")
        self.experts: FusedExperts | ClampedSwigluExperts = (
            ClampedSwigluExperts(
                num_experts, config.hidden_size, width, config.swiglu_alpha, config.swiglu_limit, _shard(tp)
            )
            if family == "gpt_oss"
            else FusedExperts(num_experts, config.hidden_size, width, _shard(tp))
        )
        shared = getattr(config, "shared_expert_intermediate_size", 0)
        self.shared_expert = MLP(config, method, tp, width=shared, reduce=False) if shared else None
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if shared else None
        self.all_reduce = _all_reduce(tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        weights, ids = self.routing.select(self.gate(x))  # [T, top_k] each
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            # The gate is replicated, so scaling each rank's partial sum scales their total: one all-reduce.
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.all_reduce is None else self.all_reduce(out)


class DecoderLayer(nn.Module):
    """Pre-norm attention and feed-forward, each added to the residual stream. Another family's layer of the same
    shape names its own attention and sparse feed-forward (engine/models/deepseek.py)."""

    attention_class: Callable[[PretrainedConfig, int, LinearMethod, TensorParallel | None], nn.Module] = Attention
    sparse_class: Callable[[PretrainedConfig, LinearMethod, TensorParallel | None], nn.Module] = SparseMoeBlock

    def __init__(self, config: PretrainedConfig, layer: int, method: LinearMethod, tp: TensorParallel | None) -> None:
        super().__init__()
        self.self_attn = self.attention_class(config, layer, method, tp)
        self.mlp = self.sparse_class(config, method, tp) if is_sparse_layer(config, layer) else MLP(config, method, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Backbone(nn.Module):
    layer_class: type[DecoderLayer] = DecoderLayer
    """What each layer is built as: the Llama family's, or another family's (engine/models/deepseek.py)."""

    def __init__(self, config: PretrainedConfig, method: LinearMethod, tp: TensorParallel | None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, shard=_shard(tp), all_reduce=_all_reduce(tp)
        )
        self.layers = nn.ModuleList(self.layer_class(config, i, method, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fused: FusedDecoder | None = None
        """Set by `LlamaFamilyForCausalLM.fuse_decoder`: the layers and final norm as one C++ call on CPU."""

    def forward(
        self,
        input_ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tensors in, tensors out (the step's metadata is read by the attention op): what compiles whole."""
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.fused is not None and (out := self.fused.forward(hidden, cos, sin, kv_caches)) is not None:
            return out
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache)
        return self.norm(hidden)


def _rope_axis_of_dim(config: PretrainedConfig, rotary_dim: int) -> torch.Tensor | None:
    """M-RoPE (`mrope_section` in the rope parameters: rotary frequencies per axis, time, height, width): each
    rotary dimension's axis `[rotary_dim]` (the two halves turn alike); None for one axis."""
    section = (getattr(config, "rope_parameters", None) or {}).get("mrope_section")
    if not section:
        return None
    if 2 * sum(section) != rotary_dim:
        raise EngineStartupError(f"mrope_section {section} does not divide the {rotary_dim} rotary dimensions")
    half = torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(section)])
    return torch.cat([half, half])


class LlamaFamilyForCausalLM(nn.Module):
    """Packed-row causal LM (the `CausalLM` protocol of engine/models/base.py): `forward` takes `[T]` token ids
    and positions and returns the final hidden states `[T, hidden]`; with `tp`, this rank's shard of it."""

    backbone_class: type[Backbone] = Backbone
    check_tensor_parallel: Callable[[PretrainedConfig, int], None] = staticmethod(check_tensor_parallel)
    fused_names: ClassVar[dict[str, tuple[str, ShardId]]] = _FUSED
    """Checkpoint name parts of the projections fused here -> (the fused module's name part, shard id)."""
    self_loading: tuple[type[nn.Module], ...] = ()
    """A family's modules that, like the linears, load their checkpoint tensors themselves (`weight_loader(name,
    tensor, shard_id)`, `loaded`): DeepSeek's absorbed projections."""

    def __init__(
        self,
        config: PretrainedConfig,
        max_positions: int,
        tp: TensorParallel | None = None,
        method: LinearMethod | None = None,
        head_method: LinearMethod | None = None,
    ) -> None:
        """`method`: the decoder's linears' (torch's matmul by default); `head_method`: the LM head's (`method` by
        default), one with a plain layout where the head is tied to the embedding."""
        super().__init__()
        if tp is not None:
            self.check_tensor_parallel(config, tp.size)
        if is_sparse(config) and isinstance(method, QuantizedLinearMethod):
            raise UnsupportedQuantization(
                method.scheme, f"this {config.model_type!r} model's experts (a mixture of experts) run in the model's "
                "dtype only; its quantized linears would leave most of its weights unquantized"
            )  # fmt: skip
        method = method or UnquantizedLinearMethod()
        self.config = config
        self.tp = tp
        self.model = self.backbone_class(config, method, tp)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, method=head_method or method, shard=_shard(tp), tied=self.tied
        )
        if self.tied:
            self.lm_head.tie_to(self.model.embed_tokens)
        self.vocab_per_rank = self.lm_head.output_size
        self.max_positions = max_positions
        cos, sin = rotary_tables(config, max_positions, torch.get_default_dtype())
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        self.register_buffer("rope_axis", _rope_axis_of_dim(config, cos.shape[-1]), persistent=False)
        self.num_layers = config.num_hidden_layers

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
    ) -> LlamaFamilyForCausalLM:
        """The model (with `tp`, this rank's shard of it) with uninitialised parameters of `dtype` on `device`, for
        weights to be loaded into (`built_empty`); the rotary tables, which are computed rather than loaded, filled
        in."""
        model = built_empty(lambda: cls(config, max_positions, tp, method, head_method), device, dtype)
        if model.tied:
            model.lm_head.tie_to(model.model.embed_tokens)
        with torch.device(device):
            model.cos_cache, model.sin_cache = rotary_tables(config, max_positions, dtype)
            model.rope_axis = _rope_axis_of_dim(config, model.cos_cache.shape[-1])
        return model

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Inside the step's context (engine/attention/context.py), which the runner enters. `positions`: `[T]`, or
        `[3, T]` for a model with M-RoPE (Qwen2-VL's language model: each stretch of rotary dimensions turns with
        one axis, time, height or width). `inputs_embeds` `[T, hidden]`, when given, replaces the embedding of
        `input_ids`. Returns the final hidden states `[T, hidden]` (what pooling reads)."""
        if positions.dim() == 1:
            cos = self.cos_cache[positions].unsqueeze(1)
            sin = self.sin_cache[positions].unsqueeze(1)
        elif self.rope_axis is not None and positions.shape[0] == 3:
            # [3, T, D] tables of each axis -> [T, D]: dimension d's angle from its own axis.
            axis = self.rope_axis.expand(positions.shape[1], -1).unsqueeze(0)
            cos = self.cos_cache[positions].gather(0, axis).squeeze(0).unsqueeze(1)
            sin = self.sin_cache[positions].gather(0, axis).squeeze(0).unsqueeze(1)
        else:
            raise ValueError(f"the {self.config.model_type} model has one rotary axis: positions must be [T], not "
                             f"{list(positions.shape)}")  # fmt: skip
        return self.model(input_ids, cos, sin, kv_caches, inputs_embeds)

    def fuse_decoder(self) -> None:
        """Once the weights are loaded: run the decoder stack as one C++ call wherever it can
        (engine/models/llama_fused.py), the modules everywhere else."""
        self.model.fused = FusedDecoder.of(self.model, FUSED_SILU_MAX_TOKENS)

    def lora_targets(self) -> dict[tuple[int, str], tuple[LinearBase, ShardId]]:
        """Each projection a LoRA adapter may adapt, by (layer, PEFT's module name): the linear computing it and
        its part there (engine/lora/)."""
        targets: dict[tuple[int, str], tuple[LinearBase, ShardId]] = {}
        for i, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            targets.update({
                (i, "q_proj"): (attn.qkv_proj, "q"),
                (i, "k_proj"): (attn.qkv_proj, "k"),
                (i, "v_proj"): (attn.qkv_proj, "v"),
                (i, "o_proj"): (attn.o_proj, None),
            })  # fmt: skip
            if isinstance(mlp, MLP):  # a sparse layer's experts take no adapters (an adapter naming them is refused)
                targets.update({
                    (i, "gate_proj"): (mlp.gate_up_proj, 0),
                    (i, "up_proj"): (mlp.gate_up_proj, 1),
                    (i, "down_proj"): (mlp.down_proj, None),
                })  # fmt: skip
        return targets

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits of `hidden`'s rows; with tensor parallelism on rank 0 only (None on the others), the
        ranks' vocabulary parts gathered side by side (padded past the real vocabulary)."""
        if self.tp is None:
            return self.lm_head(hidden).float()
        logits = self.tp.gather_columns(self.lm_head(hidden))
        return None if logits is None else logits.float()

    def cache_specs(self) -> list[CacheSpec]:
        """Each layer's KV cache: full attention, or a sliding window, of this rank's KV heads."""
        dtype = self.cos_cache.dtype
        return [attention_spec(layer.self_attn, dtype) for layer in self.model.layers]

    def attention_needs(self) -> AttentionNeeds:
        """Sliding windows where a layer has one, and gpt-oss's sinks (the family has no soft-capping or ALiBi)."""
        attention = [layer.self_attn for layer in self.model.layers]
        features = set()
        if any(attn.sliding_window is not None for attn in attention):
            features.add(AttentionFeature.SLIDING_WINDOW)
        if any(attn.sinks is not None for attn in attention):
            features.add(AttentionFeature.SINKS)
        return AttentionNeeds(frozenset(features))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Each checkpoint tensor to the module that holds it, whose `weight_loader` copies this rank's slice; a
        linear's method processes (packs) its weights as soon as its last shard is in."""
        modules = dict(self.named_modules())
        loaders = (LinearBase, *self.self_loading)
        plain = plain_parameters(self, modules, loaders)
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name or (self.tied and name == "lm_head.weight"):
                continue
            if self.config.model_type == "mixtral":
                for mixtral_part, part in _MIXTRAL_NAMES.items():
                    name = name.replace(mixtral_part, part)
            if self.config.model_type == "gpt_oss":
                name = name.replace(".mlp.router.", ".mlp.gate.")
                module_name, _, param_name = name.rpartition(".")
                module = modules.get(module_name)
                if isinstance(module, ClampedSwigluExperts):
                    module.weight_loader(param_name, tensor)
                    loaded.add(name)
                    continue
                if param_name == "sinks" and isinstance(module, Attention):  # this rank's heads
                    first = module.qkv_proj.shard.rank * module.num_heads
                    module.get_parameter("sinks").copy_(tensor.narrow(0, first, module.num_heads))
                    loaded.add(name)
                    continue
            if (expert := EXPERT_NAME.match(name)) is not None:
                load_expert(modules, expert, tensor)
                continue
            shard_id = None
            for hf_part, (fused_part, part) in self.fused_names.items():
                if hf_part in name:
                    name, shard_id = name.replace(hf_part, fused_part), part
                    break
            module_name, _, param_name = name.rpartition(".")
            module = modules.get(module_name)
            if isinstance(module, (*loaders, VocabParallelEmbedding)):
                module.weight_loader(param_name, tensor, shard_id)
            elif name in plain:
                self.get_parameter(name).copy_(tensor)
            else:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the native {self.config.model_type}")
            loaded.add(name)
        check_all_loaded(modules, plain, loaded, loaders)


def attention_spec(attn: Attention, dtype: torch.dtype) -> FullAttentionSpec | SlidingWindowSpec:
    """An attention layer's KV cache: full attention, or its sliding window, of this rank's KV heads."""
    if attn.sliding_window is None:
        return FullAttentionSpec(attn.num_kv_heads, attn.head_dim, dtype)
    return SlidingWindowSpec(attn.num_kv_heads, attn.head_dim, dtype, attn.sliding_window)


def plain_parameters(model: nn.Module, modules: dict[str, nn.Module], loaders: tuple[type, ...]) -> set[str]:
    """The parameters a checkpoint tensor is copied into as it is: all but those of layers that load their own
    (`loaders`: linears, `weight_loader` and `loaded`) and of stacked experts."""
    return {
        name
        for name, _ in model.named_parameters()
        if not isinstance(modules[name.rpartition(".")[0]], (*loaders, FusedExperts))
    }


def check_all_loaded(
    modules: dict[str, nn.Module], plain: set[str], loaded: set[str], loaders: tuple[type, ...]
) -> None:
    """ValueError naming what the checkpoint left unloaded: plain parameters, self-loading layers, experts' pieces."""
    missing = (plain - loaded) | {
        f"{name}.weight" for name, module in modules.items() if isinstance(module, loaders) and not module.loaded
    }
    missing |= {
        f"{name}.{piece}" for name, module in modules.items() if isinstance(module, FusedExperts)
        for piece in module.missing()
    }  # fmt: skip
    if missing:
        raise ValueError(f"checkpoint lacks tensors for: {sorted(missing)}")


def load_expert(modules: dict[str, nn.Module], match: re.Match[str], tensor: torch.Tensor) -> None:
    """One expert's matrix, or all experts' stacked (an `EXPERT_NAME` match), into its layer's `FusedExperts`."""
    experts = modules.get(f"{match['layer']}.experts")
    if not isinstance(experts, FusedExperts):
        raise ValueError(f"checkpoint tensor {match.group(0)!r} has no place: {match['layer']} is not sparse here")
    if match["stacked"] == "gate_up_proj":  # [experts, 2 * width, hidden]: gates, then ups
        gate, up = tensor.chunk(2, dim=1)
        parts = [("gate", gate), ("up", up)]
    elif match["stacked"] == "down_proj":
        parts = [("down", tensor)]
    elif match["part"] in _EXPERT_PARTS:
        parts = [(_EXPERT_PARTS[match["part"]], tensor)]
    else:
        raise ValueError(f"checkpoint tensor {match.group(0)!r}: an expert has no {match['part']!r}")
    expert = None if match["stacked"] else int(match["expert"])
    for part, matrix in parts:
        experts.weight_loader(expert, part, matrix)
