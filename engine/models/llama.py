"""Native Llama-family decoder (Llama, Qwen2, Qwen3, Mistral): the fast path.

Differences from the transformers modules are for speed only: fused QKV and gate/up projections, rotary cos/sin
precomputed once for every position, the packed `[T, ...]` layout with no batch dimension, attention through a
paged backend, and no mask building per step. The maths (and so greedy output) is the same.

The decoder (`Backbone.forward`, and each `DecoderLayer`) takes and returns tensors only: a layer's attention
finds the step's metadata in the step context (`engine/attention/context.py`), so `engine/execution/compile.py` can
compile a layer, or the whole decoder, into a graph that does not change from step to step.

With tensor parallelism (`tp`) each rank builds its shard, Megatron-style: QKV and gate/up are column-parallel
(this rank's attention heads, KV heads and MLP columns), o and down row-parallel with one all-reduce each, the
embedding and the LM head vocab-parallel (the logits of the sampling rows are gathered on rank 0 only). With fewer
KV heads than ranks each KV head is replicated on the ranks whose query heads read it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from engine.attention import AttentionBackend
from engine.attention.graph_op import paged_attention
from engine.config import EngineStartupError
from engine.distributed.parallel import TensorParallel

NATIVE_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})

# transformers checkpoint name -> (fused parameter name, shard index)
_FUSED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale in the input dtype, as the transformers modules do.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


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
    if problems:
        raise EngineStartupError(
            f"this {config.model_type} model cannot be split over --tensor-parallel-size {size}: " + "; ".join(problems)
        )


def _ranks(tp: TensorParallel | None) -> int:
    return 1 if tp is None else tp.size


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer: int, tp: TensorParallel | None) -> None:
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # This rank's heads; a KV head shared by more ranks than there are KV heads is replicated on each.
        self.num_heads = config.num_attention_heads // _ranks(tp)
        self.num_kv_heads = max(1, config.num_key_value_heads // _ranks(tp))
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_bias = config.model_type == "qwen2" or getattr(config, "attention_bias", False)
        out_bias = config.model_type != "qwen2" and getattr(config, "attention_bias", False)
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=out_bias)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.sliding_window = sliding_window_of_layer(config, layer)
        self.layer = layer
        self.tp = tp

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
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = paged_attention(q, k, v, kv_cache, self.scale, self.sliding_window)
        out = self.o_proj(out.reshape(tokens, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TensorParallel | None) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.intermediate = config.intermediate_size // _ranks(tp)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate, bias=bias)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        out = self.down_proj(F.silu(gate) * up)
        return out if self.tp is None else self.tp.all_reduce(out)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding table (`vocab_per_rank` from `start`, the last rank's padded with zeros):
    a token another rank holds embeds as zeros here, and the all-reduce adds up each token's one real row."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.vocab_per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.vocab_per_rank
        self.weight = nn.Parameter(torch.empty(self.vocab_per_rank, hidden_size))
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        elsewhere = (local < 0) | (local >= self.vocab_per_rank)
        hidden = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return self.tp.all_reduce(hidden.masked_fill_(elsewhere.unsqueeze(-1), 0.0))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer: int, tp: TensorParallel | None) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer, tp)
        self.mlp = MLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Backbone(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TensorParallel | None) -> None:
        super().__init__()
        self.embed_tokens = (
            nn.Embedding(config.vocab_size, config.hidden_size)
            if tp is None
            else VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Tensors in, tensors out (the step's metadata is read by the attention op): what compiles whole."""
        hidden = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache)
        return self.norm(hidden)


class LlamaFamilyForCausalLM(nn.Module):
    """Packed-row causal LM: `forward` takes `[T]` token ids and positions and returns `[T, hidden]`; with `tp`,
    this rank's shard of it."""

    def __init__(
        self,
        config: PretrainedConfig,
        backend: AttentionBackend,
        max_positions: int,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        if tp is not None:
            check_tensor_parallel(config, tp.size)
        self.config = config
        self.tp = tp
        self.backend = backend
        self.model = Backbone(config, tp)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.vocab_per_rank = -(-config.vocab_size // _ranks(tp))
        self.lm_head = nn.Linear(config.hidden_size, self.vocab_per_rank, bias=False)
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.max_positions = max_positions
        cos, sin = self._rotary_tables(torch.get_default_dtype())
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = self.model.layers[0].self_attn.num_kv_heads
        """This rank's KV heads: what its KV cache holds."""
        self.head_dim = self.model.layers[0].self_attn.head_dim
        self.sliding_windows = [layer.self_attn.sliding_window for layer in self.model.layers]

    def _rotary_tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for every position, computed in float32 by the transformers rotary module itself (all rope
        scaling types), then stored in `dtype`."""
        rotary = LlamaRotaryEmbedding(self.config)
        positions = torch.arange(self.max_positions)[None, :]
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
        return cos[0].to(dtype), sin[0].to(dtype)

    @classmethod
    def empty(
        cls,
        config: PretrainedConfig,
        backend: AttentionBackend,
        max_positions: int,
        device: torch.device,
        dtype: torch.dtype,
        tp: TensorParallel | None = None,
    ) -> LlamaFamilyForCausalLM:
        """The model (with `tp`, this rank's shard of it) with uninitialised parameters of `dtype` on `device`, for
        weights to be loaded into.

        Built on the meta device first: nothing is initialised only to be overwritten, and no float32 copy of the
        parameters ever exists. The rotary tables, which are computed rather than loaded, are filled in.
        """
        with torch.device("meta"):
            model = cls(config, backend, max_positions, tp)
        model = model.to(dtype).to_empty(device=device)
        if model.tied:
            model.lm_head.weight = model.model.embed_tokens.weight
        with torch.device(device):
            model.cos_cache, model.sin_cache = model._rotary_tables(dtype)
        return model

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Inside the step's context (engine/attention/context.py), which the runner enters."""
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        return self.model(input_ids, cos, sin, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits of `hidden`'s rows; with tensor parallelism on rank 0 only (None on the others), the
        ranks' vocabulary parts gathered side by side (padded past the real vocabulary)."""
        if self.tp is None:
            return self.lm_head(hidden).float()
        logits = self.tp.gather_columns(self.lm_head(hidden))
        return None if logits is None else logits.float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name or (self.tied and name == "lm_head.weight"):
                continue
            shard = None
            for hf_part, (fused_part, index) in _FUSED.items():
                if hf_part in name:
                    name, shard = name.replace(hf_part, fused_part), index
                    break
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the native {self.config.model_type}")
            param = params[name]
            tensor = self._rank_part(name, shard, tensor)
            if shard is None:
                param.copy_(tensor)
            else:
                param.narrow(0, *self._shard_range(name, shard)).copy_(tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {sorted(missing)}")

    def _rank_part(self, name: str, shard: int | None, tensor: torch.Tensor) -> torch.Tensor:
        """The part of checkpoint tensor `tensor` this rank holds (all of it without tensor parallelism). `name` is
        its parameter's name, and for a part of a fused parameter `shard` says which (q, k, v or gate, up)."""
        tp = self.tp
        if tp is None:
            return tensor
        attn, mlp = self.model.layers[0].self_attn, self.model.layers[0].mlp
        if ".qkv_proj." in name:
            if shard == 0:  # q: this rank's heads
                return tensor.narrow(0, tp.rank * attn.q_size, attn.q_size)
            # k or v: this rank's KV heads; with fewer KV heads than ranks, the one its query heads read.
            first_head = tp.rank * self.config.num_key_value_heads // tp.size
            return tensor.narrow(0, first_head * attn.head_dim, attn.kv_size)
        if ".gate_up_proj." in name:
            return tensor.narrow(0, tp.rank * mlp.intermediate, mlp.intermediate)
        if name.endswith((".o_proj.weight", ".down_proj.weight")):
            width = tensor.shape[1] // tp.size
            return tensor.narrow(1, tp.rank * width, width)
        if name.endswith((".o_proj.bias", ".down_proj.bias")):
            # Added once to the sum the all-reduce forms: rank 0 holds the bias, the other ranks zeros.
            return tensor if tp.is_driver else torch.zeros_like(tensor)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = tensor[tp.rank * self.vocab_per_rank : (tp.rank + 1) * self.vocab_per_rank]
            part = tensor.new_zeros(self.vocab_per_rank, tensor.shape[1])
            part[: rows.shape[0]] = rows
            return part
        return tensor

    def _shard_range(self, name: str, shard: int) -> tuple[int, int]:
        if ".qkv_proj." in name:
            attn = self.model.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [self.model.layers[0].mlp.intermediate] * 2
        return sum(sizes[:shard]), sizes[shard]
