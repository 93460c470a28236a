"""Which class runs a model: its architecture name (config.json's `architectures[0]`) to a `CausalLM` class.

A natively implemented architecture runs on its own modules; any other, and any model under
`--model-impl transformers`, on the transformers fallback (`TransformersCausalLM`, the entry under `TRANSFORMERS`).
`--model-impl auto` takes the native class only where it runs the model exactly (engine/models/support.py), and
`--model-impl native` refuses, by name, a model it cannot run that way.

Adding a family is one file and one line: write `engine/models/<family>.py` with a class implementing
`engine/models/base.py`'s `CausalLM` (build it on engine/layers/ and give it the `empty(...)` constructor and
`load_weights` that `LlamaFamilyForCausalLM` has), then add `"<Architecture>ForCausalLM": <Class>` to
`NATIVE_MODELS` below.
"""

from __future__ import annotations

from typing import Literal

from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from engine.models.base import CausalLM
from engine.models.deepseek import DeepseekForCausalLM
from engine.models.gemma3 import Gemma3ForConditionalGeneration
from engine.models.hf_adapter import TransformersCausalLM
from engine.models.hybrid import BambaForCausalLM, GraniteMoeHybridForCausalLM, JambaForCausalLM
from engine.models.llama import LlamaFamilyForCausalLM
from engine.models.llava import LlavaForConditionalGeneration, LlavaNextForConditionalGeneration
from engine.models.qwen2_vl import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration
from engine.models.state_space import MambaForCausalLM
from engine.models.support import UnsupportedModelError, check_supported, unsupported_feature

TRANSFORMERS = "TransformersForCausalLM"
"""The fallback's entry: any causal LM transformers has, through paged attention."""

NATIVE_MODELS: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaFamilyForCausalLM,
    "Qwen2ForCausalLM": LlamaFamilyForCausalLM,
    "Qwen3ForCausalLM": LlamaFamilyForCausalLM,
    "MistralForCausalLM": LlamaFamilyForCausalLM,
    "MixtralForCausalLM": LlamaFamilyForCausalLM,
    "Qwen2MoeForCausalLM": LlamaFamilyForCausalLM,
    "Qwen3MoeForCausalLM": LlamaFamilyForCausalLM,
    "GptOssForCausalLM": LlamaFamilyForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    "Glm4MoeLiteForCausalLM": DeepseekForCausalLM,
    "MambaForCausalLM": MambaForCausalLM,
    "FalconMambaForCausalLM": MambaForCausalLM,
    "Mamba2ForCausalLM": MambaForCausalLM,
    "JambaForCausalLM": JambaForCausalLM,
    "BambaForCausalLM": BambaForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
}
"""Architectures with modules of Ferry's own."""

VISION_MODELS: dict[str, type[CausalLM]] = {
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "LlavaNextForConditionalGeneration": LlavaNextForConditionalGeneration,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
}
"""Image models (engine/models/vision_language.py): a vision encoder in front of a native language model, whose
`text_config` names one of `VISION_TEXT_TYPES`."""

VISION_TEXT_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen2_vl_text", "qwen2_5_vl_text"})
"""The language models an image model's native modules run (the Llama family's dense members)."""

ADAPTED_VISION_MODELS = frozenset({"Gemma3ForConditionalGeneration"})
"""Image models whose language model runs on transformers' modules through the adapter (no native modules)."""

MODELS: dict[str, type[CausalLM]] = {**NATIVE_MODELS, TRANSFORMERS: TransformersCausalLM}

BASE_MODELS: dict[str, str] = {
    "LlamaModel": "LlamaForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
    "MistralModel": "MistralForCausalLM",
}
"""Base models (no LM head) of the native families, as sentence-transformers saves an embedding model built on
one: the causal LM's modules run them, for pooling."""

ModelImpl = Literal["auto", "native", "transformers"]


def architecture(config: PretrainedConfig) -> str:
    """config.json's `architectures[0]`, or for a config without one, transformers' causal LM class of its type."""
    names = getattr(config, "architectures", None)
    if names:
        return names[0]
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, config.model_type)


def choose_model_class(config: PretrainedConfig, model_impl: ModelImpl) -> type[CausalLM]:
    """The class that runs `config`'s model under `model_impl`; raises UnsupportedModelError, naming the
    feature, for a model the chosen implementation cannot run exactly."""
    native = NATIVE_MODELS.get(architecture(config))
    if model_impl == "native" and native is None:
        raise UnsupportedModelError(
            config.model_type,
            f"--model-impl native (native modules exist for {', '.join(sorted(NATIVE_MODELS))}; this model is "
            f"{architecture(config)})",
        )
    use_native = native is not None and (
        model_impl == "native" or (model_impl == "auto" and unsupported_feature(config, native=True) is None)
    )
    check_supported(config, native=use_native)
    return native if use_native and native is not None else MODELS[TRANSFORMERS]
