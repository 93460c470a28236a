"""Which layers of a model's config are mixtures of experts, from the config alone: the model builder's question
(engine/models/llama.py) and an adapter reader's (engine/lora/adapter.py), which the front end asks without the
modules and kernels of engine/layers/moe.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

DEEPSEEK = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")
"""DeepSeek's family: V2, V3, and GLM-4.7-Flash (a V3 whose dense and sparse layers are listed)."""


def is_sparse(config: PretrainedConfig) -> bool:
    """Whether `config` is a mixture of experts with native modules (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss,
    DeepSeek's family)."""
    return config.model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", *DEEPSEEK)


def is_sparse_layer(config: PretrainedConfig, layer: int) -> bool:
    """Whether `layer`'s feed-forward is a mixture of experts: every layer of Mixtral and gpt-oss; DeepSeek's from
    `first_k_dense_replace` on (GLM's where `mlp_layer_types` says "sparse"); Qwen's every `decoder_sparse_step`-th
    layer not in `mlp_only_layers`, as transformers builds them."""
    if config.model_type in ("mixtral", "gpt_oss"):
        return True
    if config.model_type == "glm4_moe_lite":
        return config.mlp_layer_types[layer] == "sparse"
    if config.model_type in DEEPSEEK:
        return layer >= config.first_k_dense_replace and config.n_routed_experts > 0
    if not is_sparse(config):
        return False
    return (
        layer not in (config.mlp_only_layers or [])
        and config.num_experts > 0
        and (layer + 1) % config.decoder_sparse_step == 0
    )
