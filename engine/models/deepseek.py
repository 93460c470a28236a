"""Native DeepSeek V2 and V3 (and the models built on them: V2-Lite, R1, Kimi K2; GLM-4.7-Flash, a V3 with its
dense and sparse layers listed): multi-head latent attention over a latent cache, and DeepSeek's mixture of experts,
on the Llama family's backbone (engine/models/llama.py).

Latent attention (MLA): the layer computes the query, the normed latent and the rotary key, and
engine/attention/latent.py attends (absorbed over the latent cache for decodes and chunks, expanded for fresh
prompts); the scale is transformers' (`qk_head_dim ** -0.5`, times YaRN's `mscale_all_dim` factor squared).

DeepSeek lays the rotary dimensions out in interleaved pairs (V2 always, V3 under `rope_interleave`): the rotary rows
of the query and latent projections are permuted once at load into the halves layout `apply_rotary` rotates, which
leaves every score as it is (the query and key parts are permuted alike).

Mixture of experts: a float32 router with DeepSeek's grouped top-k (`GroupedRouting`), routed experts as the other
families' (`FusedExperts`), shared experts added to every token's mix; the first `first_k_dense_replace` layers are
dense.

Tensor parallelism splits heads (the query's and `kv_b_proj`'s rows, `o_proj`'s columns) and each expert's width;
the latent projection is replicated, so every rank caches the whole latent.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionFeature, AttentionNeeds
from engine.attention.latent import latent_attention
from engine.attention.spec import CacheSpec, LatentAttentionSpec
from engine.config import EngineStartupError
from engine.distributed.parallel import TensorParallel
from engine.layers.linear import ColumnParallelLinear, LinearBase, ReplicatedLinear, RowParallelLinear, ShardId
from engine.layers.linear_method import LinearMethod
from engine.layers.moe import FusedExperts, GroupedRouting
from engine.layers.norm import RMSNorm
from engine.layers.rotary import apply_rotary
from engine.models.llama import _FUSED, MLP, Backbone, DecoderLayer, LlamaFamilyForCausalLM, _all_reduce, _shard

if TYPE_CHECKING:
    from transformers import PretrainedConfig


LATENT_NORM_EPS = 1e-6
"""The query's and the latent's norms use transformers' default epsilon, not the config's `rms_norm_eps`."""


def check_tensor_parallel(config: PretrainedConfig, size: int) -> None:
    """Raise EngineStartupError, saying why, when `config`'s model cannot be split over `size` ranks exactly."""
    problems = []
    if config.num_attention_heads % size:
        problems.append(f"its {config.num_attention_heads} attention heads do not divide by {size}")
    for name in ("intermediate_size", "moe_intermediate_size"):
        if getattr(config, name) % size:
            problems.append(f"its {name} {getattr(config, name)} does not divide by {size}")
    if problems:
        raise EngineStartupError(
            f"this {config.model_type} model cannot be split over --tensor-parallel-size {size}: " + "; ".join(problems)
        )


def softmax_scale(config: PretrainedConfig) -> float:
    """`qk_head_dim ** -0.5`, times YaRN's attention factor squared where `mscale_all_dim` is set (transformers'
    `yarn_apply_mscale`)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = rope["factor"]
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


def rope_interleaved(config: PretrainedConfig) -> bool:
    """Whether the checkpoint's rotary dimensions come in interleaved pairs (V2's complex rotation; V3's default)."""
    return config.model_type == "deepseek_v2" or bool(getattr(config, "rope_interleave", True))


def deinterleave_rows(matrix: torch.Tensor, rope: int) -> torch.Tensor:
    """`matrix` `[rows, ...]` whose last `rope` rows are interleaved pairs `(x0, x1), (x2, x3), ...` with those rows
    as halves `(x0, x2, ...), (x1, x3, ...)`."""
    first = matrix.shape[0] - rope
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)]) + first
    return torch.cat([matrix[:first], matrix[order]])


class AbsorbedProjection(nn.Module):
    """`kv_b_proj` (`[heads * (nope + v), latent]`), this rank's heads split into the two plain matrices the absorbed
    products read: W_UK `[h, nope, latent]` (into the query) and W_UV `[h, v, latent]` (out of the mixed latents)."""

    def __init__(self, heads: int, rank: int, nope: int, v_dim: int, latent: int) -> None:
        super().__init__()
        self.heads, self.rank = heads, rank
        self.w_uk = nn.Parameter(torch.empty(heads, nope, latent), requires_grad=False)
        self.w_uv = nn.Parameter(torch.empty(heads, v_dim, latent), requires_grad=False)
        self.loaded = False

    @torch.no_grad()
    def weight_loader(self, name: str, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if name != "weight" or shard_id is not None:
            raise ValueError(f"kv_b_proj has no {name!r} (shard {shard_id!r})")
        nope, latent = self.w_uk.shape[1:]
        mine = loaded.view(-1, nope + self.w_uv.shape[1], latent).narrow(0, self.rank * self.heads, self.heads)
        self.w_uk.copy_(mine[:, :nope])
        self.w_uv.copy_(mine[:, nope:])
        self.loaded = True


class LatentAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer: int, method: LinearMethod, tp: TensorParallel | None) -> None:
        super().__init__()
        shard = _shard(tp)
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.latent = config.kv_lora_rank
        head_size = self.nope + self.rope
        heads = config.num_attention_heads
        self.num_heads = heads // shard.size  # this rank's
        bias = config.attention_bias
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(config.hidden_size, heads * head_size, bias=False, method=method,
                                               shard=shard)  # fmt: skip
        else:
            self.q_a_proj = ReplicatedLinear(config.hidden_size, self.q_lora_rank, bias=bias, method=method)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * head_size, bias=False, method=method,
                                                 shard=shard)  # fmt: skip
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            config.hidden_size, self.latent + self.rope, bias=bias, method=method
        )
        self.kv_a_layernorm = RMSNorm(self.latent, LATENT_NORM_EPS)
        self.kv_b_proj = AbsorbedProjection(self.num_heads, shard.rank, self.nope, self.v_dim, self.latent)
        self.o_proj = RowParallelLinear(heads * self.v_dim, config.hidden_size, bias=bias, method=method, shard=shard,
                                        all_reduce=_all_reduce(tp))  # fmt: skip
        self.scale = softmax_scale(config)
        self.sliding_window = None  # every layer attends fully (what a layer's kind of compiled graph is told by)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(tokens, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)  # [T, h, nope], [T, h, rope]
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.latent, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())  # [T, latent]
        q_pe = apply_rotary(q_pe.contiguous(), cos, sin)
        k_pe = apply_rotary(k_pe.reshape(tokens, 1, self.rope), cos, sin)  # [T, 1, rope]
        # A latent layer's K and V pages are one tensor (engine/execution/kv_caches.py).
        out = latent_attention(
            q_nope, q_pe, latent, k_pe, self.kv_b_proj.w_uk, self.kv_b_proj.w_uv, kv_cache[0], self.scale
        )  # [T, h, v]
        return self.o_proj(out.reshape(tokens, self.num_heads * self.v_dim))


class Router(nn.Module):
    """The router's float32 logits (its matrix stays float32 whatever the model's dtype, as transformers keeps it),
    and V3's float32 correction bias."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        experts = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(experts, config.hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(experts, dtype=torch.float32), requires_grad=False)
            if config.model_type != "deepseek_v2"
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, experts] float32
        return F.linear(x.float(), self.weight)


class DeepseekMoe(nn.Module):
    def __init__(self, config: PretrainedConfig, method: LinearMethod, tp: TensorParallel | None) -> None:
        super().__init__()
        self.gate = Router(config)
        self.routing = GroupedRouting.of(config)
        self.experts = FusedExperts(
            config.n_routed_experts, config.hidden_size, config.moe_intermediate_size, _shard(tp)
        )
        shared = (config.n_shared_experts or 0) * config.moe_intermediate_size
        self.shared_experts = MLP(config, method, tp, width=shared, reduce=False) if shared else None
        self.all_reduce = _all_reduce(tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        weights, ids = self.routing.select(self.gate(x), self.gate.e_score_correction_bias)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:  # each rank's partial sums of both, one all-reduce
            out = out + self.shared_experts(x)
        return out if self.all_reduce is None else self.all_reduce(out)


class DeepseekDecoderLayer(DecoderLayer):
    attention_class = LatentAttention
    sparse_class = DeepseekMoe


class DeepseekBackbone(Backbone):
    layer_class = DeepseekDecoderLayer


_ROTARY_ROWS = {"q_proj", "q_b_proj"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
"""Projections whose per-head rows end in the query's rotary part."""


class DeepseekForCausalLM(LlamaFamilyForCausalLM):
    """DeepSeek V2 / V3 (and GLM-4.7-Flash) on the packed row: the Llama family's model around latent-attention
    decoder layers."""

    backbone_class = DeepseekBackbone
    check_tensor_parallel = staticmethod(check_tensor_parallel)
    self_loading = (AbsorbedProjection,)
    fused_names: ClassVar[dict[str, tuple[str, ShardId]]] = {
        part: fused for part, fused in _FUSED.items() if fused[0] == ".gate_up_proj."
    }
    """Gate and up only: the attention's projections are DeepSeek's own."""

    def cache_specs(self) -> list[CacheSpec]:
        """Every layer's latent and rotary key, whole on every rank."""
        dtype = self.cos_cache.dtype
        return [LatentAttentionSpec(self.config.kv_lora_rank, self.config.qk_rope_head_dim, dtype)] * self.num_layers

    def attention_needs(self) -> AttentionNeeds:
        return AttentionNeeds(frozenset({AttentionFeature.LATENT}))

    def fuse_decoder(self) -> None:
        """The C++ decoder stack runs the Llama family's layers only: DeepSeek's run as modules."""

    def lora_targets(self) -> dict[tuple[int, str], tuple[LinearBase, ShardId]]:
        raise EngineStartupError(
            f"--enable-lora: adapters on a {self.config.model_type} model (latent attention, absorbed projections) "
            "are not served"
        )

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The Llama family's loading, after two of DeepSeek's own steps: the layers past `num_hidden_layers` (the
        multi-token-prediction layer V3 and GLM checkpoints carry, which transformers skips too) are skipped, and
        the rotary rows are de-interleaved where the checkpoint interleaves them."""
        interleaved = rope_interleaved(self.config)
        rope = self.config.qk_rope_head_dim
        head_size = self.config.qk_nope_head_dim + rope

        def decoder_tensors(stream: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in stream:
                layer = _LAYER.match(name)
                if layer is not None and int(layer[1]) >= self.num_layers:
                    continue
                module_name, _, param_name = name.rpartition(".")
                projection = module_name.rpartition(".")[2]
                if interleaved and param_name in ("weight", "bias") and projection in _ROTARY_ROWS:
                    per_head = tensor.view(-1, head_size, *tensor.shape[1:])
                    tensor = torch.stack([deinterleave_rows(head, rope) for head in per_head]).flatten(0, 1)
                elif interleaved and param_name in ("weight", "bias") and projection == "kv_a_proj_with_mqa":
                    tensor = deinterleave_rows(tensor, rope)
                yield name, tensor

        super().load_weights(decoder_tensors(weights))
