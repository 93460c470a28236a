"""What the engine can run exactly, and the typed refusal of the rest.

A model is served only if every feature it uses is implemented on the path that runs it; anything else is refused
when the model loads, with an error naming the model type and the feature, never served approximately. The checks
here read the config; what only running the model reveals (attention the adapter cannot reach, attention arguments
it does not implement, logits post-processed after the head) the adapter probes at load
(`TransformersCausalLM.check_runs_exactly`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.config import EngineStartupError
from engine.models.config_record import CONFIG_TWINS, RecordedConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class UnsupportedModelError(EngineStartupError):
    """The model uses a feature the engine cannot run exactly."""

    def __init__(self, model_type: str, feature: str) -> None:
        super().__init__(f"model_type {model_type!r}: {feature} is not supported (refused rather than served inexact)")
        self.model_type = model_type
        self.feature = feature


_Check = Callable[["PretrainedConfig"], str | None]
"""A config -> the feature it uses that a path lacks, or None."""


def _flag(attribute: str, feature: str) -> _Check:
    return lambda config: f"{feature} ({attribute})" if getattr(config, attribute, False) else None


def _falcon_alibi(config: PretrainedConfig) -> str | None:
    if config.model_type == "falcon" and config.alibi:
        # Falcon rounds slope * absolute position to bfloat16, which no relative-position kernel reproduces.
        return "ALiBi as Falcon computes it, rounded to bfloat16 at absolute positions (alibi=True)"
    return None


def _activation(config: PretrainedConfig) -> str | None:
    act = getattr(config, "hidden_act", "silu")
    return None if act == "silu" else f"hidden_act={act!r} on the native path (its MLP is SiLU-gated)"


def _composite(config: PretrainedConfig) -> str | None:
    # A text model inside a multimodal one (sub-configs that only group options, like MPT's, do not count).
    parts = sorted(getattr(config, "sub_configs", None) or {})
    return f"a composite (multimodal) config with {', '.join(parts)}" if "text_config" in parts else None


STATE_SPACE_TYPES = frozenset({"mamba", "falcon_mamba", "mamba2", "jamba", "bamba", "granitemoehybrid"})
"""Model types with recurrent (state-space) layers that Ferry's native modules run, their state in slots
(engine/models/state_space.py, engine/models/hybrid.py)."""

UNCLAIMED_RECURRENT_TYPES = frozenset({
    "falcon_h1", "nemotron_h", "zamba", "zamba2", "qwen3_next", "lfm2", "lfm2_moe", "lfm3", "minimax", "rwkv",
    "recurrent_gemma", "xlstm", "plamo2",
})  # fmt: skip
"""Other model types whose layers keep a recurrent state per sequence (state-space, linear attention, RNN) rather
than K and V per token: transformers has them, Ferry has no modules that keep their state."""


RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "mamba", "conv", "recurrent", "mlstm", "slstm"})
"""Per-layer kinds (`layer_types`, `layers_block_type`) that keep a recurrent state: a hybrid of a family not named
above (Qwen3.5's gated delta-net, Kimi Linear, OLMo hybrid) is known by them."""


def _layer_kinds(config: PretrainedConfig) -> set[str]:
    kinds: set[str] = set()
    for attribute in ("layer_types", "layers_block_type"):
        value = getattr(config, attribute, None)
        if isinstance(value, list | tuple):
            kinds |= {kind for kind in value if isinstance(kind, str)}
    return kinds


def _recurrent(config: PretrainedConfig) -> str | None:
    if config.model_type in STATE_SPACE_TYPES:
        return None
    if config.model_type in UNCLAIMED_RECURRENT_TYPES or _layer_kinds(config) & RECURRENT_LAYER_TYPES:
        return (
            "recurrent layers (state-space, linear-attention or RNN) of a family Ferry has no native modules for; "
            f"their per-sequence state runs natively for {', '.join(sorted(STATE_SPACE_TYPES))} only"
        )
    return None


def _recurrent_on_adapter(config: PretrainedConfig) -> str | None:
    if config.model_type in STATE_SPACE_TYPES:
        return "recurrent layers on the transformers adapter, which keeps K and V in pages, not per-sequence state"
    return None


def _layout(config: PretrainedConfig) -> str | None:
    # The paged cache is sized from these: a model without them (or with them per layer) is refused here rather than
    # failing on them later.
    varying = getattr(config, "per_layer_attributes", None)
    if varying:  # reading one of them at the top raises
        return f"attributes that vary from layer to layer ({', '.join(sorted(varying))})"
    if getattr(config, "num_hidden_layers", None) is None:
        return "a config without num_hidden_layers at its top (a model made of sub-models)"
    if getattr(config, "num_attention_heads", None) is None and config.model_type not in STATE_SPACE_TYPES:
        return "layers without attention heads (no num_attention_heads: a state-space or recurrent model)"
    return None


_REFUSED: tuple[_Check, ...] = (
    _recurrent,
    _composite,
    _layout,
    _flag("is_encoder_decoder", "an encoder-decoder architecture"),
    _flag("add_cross_attention", "cross-attention"),
    _flag("use_bidirectional_attention", "bidirectional attention"),
    _falcon_alibi,
)
"""Features no path implements."""


def _mxfp4_native(config: PretrainedConfig) -> str | None:
    return (
        "MXFP4 experts on the native modules (the adapter dequantizes them as it loads)"
        if (dequantized_at_load(config))
        else None
    )


_REFUSED_NATIVE: tuple[_Check, ...] = (_activation, _mxfp4_native)
"""Features the native modules lack (the transformers adapter may run them)."""


def dequantized_at_load(config: PretrainedConfig) -> bool:
    """Whether the checkpoint's weights are stored quantized in a form the transformers adapter dequantizes as it
    loads them: gpt-oss's MXFP4 experts (exact in bfloat16 and float32: a 4-bit value times a power of two)."""
    quantization = getattr(config, "quantization_config", None) or {}
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization.quant_method
    return config.model_type == "gpt_oss" and method == "mxfp4"


def _quantized_on_adapter(config: PretrainedConfig) -> str | None:
    # transformers would load it through a quantization library of its own, dequantizing or not: quantized
    # checkpoints run on the native modules, on Ferry's kernels (engine/quantization/checkpoints.py), except the
    # one format transformers dequantizes exactly at load.
    if getattr(config, "quantization_config", None) and not dequantized_at_load(config):
        return "a quantized checkpoint on the transformers adapter (quantization_config)"
    return None


_REFUSED_ADAPTER: tuple[_Check, ...] = (_quantized_on_adapter, _recurrent_on_adapter)
"""Features the transformers adapter does not run."""


def check_config_code(config_json: dict[str, Any]) -> None:
    """Refuse by name a checkpoint whose config is code of its own (config.json's `auto_map`) for a model type that
    transformers does not know and that is no copy of a known family's (`CONFIG_TWINS`): Ferry runs no checkpoint
    code. A known model type is read through transformers' class, as transformers reads it without that code."""
    code = (config_json.get("auto_map") or {}).get("AutoConfig")
    model_type = config_json.get("model_type")
    if code is None or model_type in CONFIG_TWINS:
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        raise UnsupportedModelError(
            str(model_type),
            f"configuration code of the checkpoint's own ({code}, in config.json's auto_map: Ferry runs no checkpoint "
            f"code, and reads transformers' model types and {', '.join(sorted(CONFIG_TWINS))})",
        )


def has_causal_lm_class(config: PretrainedConfig | RecordedConfig) -> bool:
    """Whether transformers has a causal LM class for `config`'s model type; a recorded config
    (engine/models/config_record.py) holds the answer transformers gave when it was recorded."""
    if isinstance(config, RecordedConfig):
        return config.transformers_has_causal_lm
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def unsupported_feature(config: PretrainedConfig, native: bool, inside_image_model: bool = False) -> str | None:
    """The first feature of `config` the chosen path (native modules, or the transformers adapter) cannot run
    (whether native modules exist for it at all, the registry says: engine/models/registry.py).
    `inside_image_model`: `config` is an image model's language model, which transformers may have no causal LM
    class of its own for (Qwen2-VL's)."""
    if not has_causal_lm_class(config) and not inside_image_model:
        return "no causal language-model class in transformers"
    for check in _REFUSED + (_REFUSED_NATIVE if native else _REFUSED_ADAPTER):
        feature = check(config)
        if feature is not None:
            return feature
    return None


def check_supported(config: PretrainedConfig, native: bool) -> None:
    feature = unsupported_feature(config, native)
    if feature is not None:
        raise UnsupportedModelError(config.model_type, feature)
