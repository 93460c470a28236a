"""How the attention of transformers models reaches the step's paged backend.

Most models call attention through transformers' attention interface: `paged_attention`, registered under
`ferry_paged`, hands their Q/K/V (and the soft-cap, sliding window and attention sinks they pass) to the backend. A
few compute attention in modules of their own, and get paged modules from here:
- Falcon looks its attention class up in a table of its own keyed by the implementation name
  (`FALCON_ATTENTION_CLASSES`); `PagedFalconAttention` is its `ferry_paged` entry.
- Bloom builds `BloomAttention` by name, so `replace_own_attention` swaps those modules for `PagedBloomAttention`
  after loading, keeping their parameters. Bloom's ALiBi slopes are one tensor that all those modules share, so the
  backend builds its biased masks once per step, not once per layer.

The step's metadata reaches these calls through the step context the runner enters around each forward pass
(engine/attention/context.py), looked up by layer, because transformers offers no per-call channel down to every
architecture's attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel
from transformers.models.bloom.modeling_bloom import BloomAttention, _get_alibi_slopes, dropout_add
from transformers.models.falcon.modeling_falcon import (
    FALCON_ATTENTION_CLASSES,
    FalconAttention,
    apply_rotary_pos_emb,
)

from engine.attention.base import AttentionFeature
from engine.attention.context import AttentionCall, StepContext, current_step

ATTN_IMPLEMENTATION = "ferry_paged"

_SINK_ARGUMENTS = ("s_aux", "sinks")
"""The names models pass their per-head attention sinks under (gpt-oss: `s_aux`)."""
_IMPLEMENTED_ARGUMENTS = frozenset({"sliding_window", "softcap", *_SINK_ARGUMENTS})  # beside `scaling`, `dropout`
_NO_EFFECT_ARGUMENTS = frozenset(
    {
        "is_causal",  # read as `causal` below
        "position_ids",  # positions are already in the rotated Q/K
        "output_attentions",
        "use_cache",  # the paged cache is the only cache
        "cu_seq_lens_q",  # flash-attn varlen hints: the step's metadata describes the packing
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "deterministic",
    }
)
KNOWN_ARGUMENT_FEATURES = {
    "position_bias": "relative position biases",
    "indices": "sparse attention over selected keys",
    "block_indices": "block-sparse attention",
}
"""Attention arguments that change the result and that the paged backends do not implement, by what they are."""


def _attend(
    context: StepContext,
    layer: int,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [1, T, H, D], as transformers' attention functions return
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out = context.backend.forward(
        q,
        k,
        v,
        context.kv_caches[layer],
        context.layer_metas[layer],
        scale,
        sliding_window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
    )
    return out.unsqueeze(0)


def paged_attention(
    module: nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    context = current_step()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    softcap = kwargs.get("softcap")
    sinks = next((kwargs[name] for name in _SINK_ARGUMENTS if kwargs.get(name) is not None), None)
    if sinks is not None:
        sinks = sinks.float()  # the backends read sinks as float32 logits, whatever the model's dtype
    if context.on_call is not None:
        unimplemented = [
            name
            for name, value in kwargs.items()
            if value is not None and name not in _IMPLEMENTED_ARGUMENTS | _NO_EFFECT_ARGUMENTS
        ]
        if dropout:
            unimplemented.append("dropout")
        causal = kwargs.get("is_causal") is not False and getattr(module, "is_causal", True) is not False
        asked = {
            AttentionFeature.SLIDING_WINDOW: window,
            AttentionFeature.SOFTCAP: softcap,
            AttentionFeature.SINKS: sinks,
        }
        context.on_call(
            AttentionCall(
                module.layer_idx,
                key.shape[1],
                key.shape[-1],
                value.shape[-1],
                window,
                causal,
                attention_mask is not None,
                tuple(unimplemented),
                frozenset(feature for feature, value in asked.items() if value is not None),
            )
        )
    return _attend(context, module.layer_idx, query, key, value, scale, window, softcap, sinks=sinks), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


def _report_own_module_call(
    context: StepContext,
    layer: int,
    key: torch.Tensor,
    value: torch.Tensor,
    features: frozenset[AttentionFeature] = frozenset(),
) -> None:
    if context.on_call is not None:
        context.on_call(
            AttentionCall(layer, key.shape[1], key.shape[-1], value.shape[-1], None, True, False, (), features)
        )


class PagedFalconAttention(FalconAttention):
    """Falcon's attention on the paged backend: its fused projection and head layout (multi-query, or grouped in
    the new decoder architecture), rotary embeddings, and the default scale. ALiBi Falcons are refused at load."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        alibi: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        layer_past: object = None,
        use_cache: bool = False,
        output_attentions: bool = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        context = current_step()
        batch, tokens, _ = hidden_states.shape
        fused = self.query_key_value(hidden_states)
        if self.new_decoder_architecture:
            # Each KV head's query heads, then its key and value: keep one K/V per KV head (Falcon's own split
            # broadcasts them to every query head, which would multiply the cache by the group size).
            qkv = fused.view(batch, tokens, self.num_kv_heads, -1, self.head_dim)
            query, key, value = qkv[:, :, :, :-2].flatten(2, 3), qkv[:, :, :, -2], qkv[:, :, :, -1]
        else:
            query, key, value = self._split_heads(fused)
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))  # [1, heads, T, D]
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        _report_own_module_call(context, self.layer_idx, key, value)
        out = _attend(context, self.layer_idx, query, key, value, self.inv_norm_factor, None)
        return self.dense(out.reshape(batch, tokens, -1)), None


FALCON_ATTENTION_CLASSES[ATTN_IMPLEMENTATION] = PagedFalconAttention


class PagedBloomAttention(nn.Module):
    """Bloom's attention on the paged backend, over the parameters of the `BloomAttention` it replaces.

    ALiBi comes from the step's slopes at each token's own position: the `alibi` tensor BloomModel passes spans
    the packed row (one position per row index), not a sequence, so it is not used. Bloom adds
    `slope * key_position`; the backends add `slope * (key_position - query_position)`, which differs by a constant
    per query row that softmax ignores: the same in float32 up to rounding, and in half precision closer to exact
    than Bloom's own bias, which it rounds at absolute positions.
    """

    def __init__(self, original: BloomAttention, alibi_slopes: torch.Tensor) -> None:
        super().__init__()
        # A plain attribute, not a buffer: it stays float32 (flash-attn's requirement) whatever the model's dtype.
        self.alibi_slopes = alibi_slopes
        self.query_key_value = original.query_key_value
        self.dense = original.dense
        self.num_heads = original.num_heads
        self.head_dim = original.head_dim
        self.inv_norm_factor = original.inv_norm_factor
        self.hidden_dropout = original.hidden_dropout
        self.layer_idx = original.layer_idx

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        alibi: torch.Tensor,
        attention_mask: torch.Tensor | None,
        layer_past: object = None,
        use_cache: bool = False,
        output_attentions: bool = False,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        context = current_step()
        batch, tokens, _ = hidden_states.shape
        # Bloom's fused layout: per head, its query, key and value side by side.
        qkv = self.query_key_value(hidden_states).view(batch, tokens, self.num_heads, 3, self.head_dim)
        query, key, value = (qkv[..., i, :].transpose(1, 2) for i in range(3))  # [1, H, T, D]
        _report_own_module_call(context, self.layer_idx, key, value, frozenset({AttentionFeature.ALIBI}))
        out = _attend(
            context, self.layer_idx, query, key, value, self.inv_norm_factor, None, alibi_slopes=self.alibi_slopes
        )
        out = self.dense(out.reshape(batch, tokens, -1))
        return dropout_add(out, residual, self.hidden_dropout, self.training), None


_REPLACEMENTS: dict[type[nn.Module], Callable[[nn.Module, torch.Tensor | None], nn.Module]] = {
    BloomAttention: PagedBloomAttention
}


def replace_own_attention(model: PreTrainedModel) -> None:
    """Swap attention modules that compute attention themselves (and have no table entry) for paged ones, on the
    model's device (called once it is there: the ALiBi slopes are made for it)."""
    slopes = alibi_slopes(model.config, model.device)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            replacement = _REPLACEMENTS.get(type(child))
            if replacement is not None:
                setattr(parent, name, replacement(child, slopes))


def alibi_slopes(config: PretrainedConfig, device: torch.device) -> torch.Tensor | None:
    """The per-head ALiBi slopes ([H], float32) of the models whose paged attention adds them; None otherwise."""
    if config.model_type == "bloom":
        return _get_alibi_slopes(config.n_head, device)
    return None


def num_kv_heads(config: PretrainedConfig) -> int:
    """K/V heads per layer, as the model's attention lays them out."""
    if config.model_type == "falcon":
        return config.num_kv_heads if config.new_decoder_architecture or not config.multi_query else 1
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads
