"""Which class runs a model: its architecture name (config.json's `architectures[0]`) to a `CausalLM` class.

A natively implemented architecture runs on its own modules; any other, and any model under
`--model-impl transformers`, on the transformers fallback (`TransformersCausalLM`, the entry under `TRANSFORMERS`).
`--model-impl auto` takes the native class only where it runs the model exactly (engine/models/support.py), and
`--model-impl native` refuses, by name, a model it cannot run that way.

Adding a family is one file and one line: write `engine/models/<family>.py` with a class implementing
`engine/models/base.py`'s `CausalLM` (build it on engine/layers/ and give it the `empty(...)` constructor and
`load_weights` that `LlamaFamilyForCausalLM` has), then add
`"<Architecture>ForCausalLM": "engine.models.<family>:<Class>"` to `_NATIVE_PATHS` below.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Literal

from engine.models.base import CausalLM
from engine.models.support import UnsupportedModelError, check_supported, unsupported_feature

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Classes(Mapping[str, type[CausalLM]]):
    """Architecture name -> class, each given as "module:Class" and imported when it is first looked up: an engine
    imports the one family it runs. Several families build on transformers' modelling modules, which import its
    model-loading machinery (torch.distributed's tensors, torch._dynamo, scipy): seconds of start-up no other
    model should pay."""

    def __init__(self, paths: dict[str, str]) -> None:
        self._paths = paths

    def __getitem__(self, name: str) -> type[CausalLM]:
        module, _, attribute = self._paths[name].partition(":")
        return getattr(importlib.import_module(module), attribute)

    def __contains__(self, name: object) -> bool:
        return name in self._paths  # Mapping's own would look the class up, importing its module

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)


TRANSFORMERS = "TransformersForCausalLM"
"""The fallback's entry: any causal LM transformers has, through paged attention."""

_LLAMA = "engine.models.llama:LlamaFamilyForCausalLM"
_DEEPSEEK = "engine.models.deepseek:DeepseekForCausalLM"
_MAMBA = "engine.models.state_space:MambaForCausalLM"
_NATIVE_PATHS = {
    "LlamaForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "MixtralForCausalLM": _LLAMA,
    "Qwen2MoeForCausalLM": _LLAMA,
    "Qwen3MoeForCausalLM": _LLAMA,
    "GptOssForCausalLM": _LLAMA,
    "DeepseekV2ForCausalLM": _DEEPSEEK,
    "DeepseekV3ForCausalLM": _DEEPSEEK,
    "Glm4MoeLiteForCausalLM": _DEEPSEEK,
    "MambaForCausalLM": _MAMBA,
    "FalconMambaForCausalLM": _MAMBA,
    "Mamba2ForCausalLM": _MAMBA,
    "JambaForCausalLM": "engine.models.hybrid:JambaForCausalLM",
    "BambaForCausalLM": "engine.models.hybrid:BambaForCausalLM",
    "GraniteMoeHybridForCausalLM": "engine.models.hybrid:GraniteMoeHybridForCausalLM",
}

NATIVE_MODELS = Classes(_NATIVE_PATHS)
"""Architectures with modules of Ferry's own."""

VISION_MODELS = Classes(
    {
        "LlavaForConditionalGeneration": "engine.models.llava:LlavaForConditionalGeneration",
        "LlavaNextForConditionalGeneration": "engine.models.llava:LlavaNextForConditionalGeneration",
        "Qwen2VLForConditionalGeneration": "engine.models.qwen2_vl:Qwen2VLForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration": "engine.models.qwen2_vl:Qwen2_5_VLForConditionalGeneration",
        "Gemma3ForConditionalGeneration": "engine.models.gemma3:Gemma3ForConditionalGeneration",
    }
)
"""Image models (engine/models/vision_language.py): a vision encoder in front of a native language model, whose
`text_config` names one of `VISION_TEXT_TYPES`."""

VISION_TEXT_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen2_vl_text", "qwen2_5_vl_text"})
"""The language models an image model's native modules run (the Llama family's dense members)."""

ADAPTED_VISION_MODELS = frozenset({"Gemma3ForConditionalGeneration"})
"""Image models whose language model runs on transformers' modules through the adapter (no native modules)."""

MODELS = Classes({**_NATIVE_PATHS, TRANSFORMERS: "engine.models.hf_adapter:TransformersCausalLM"})

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
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, config.model_type)


def runs_native(config: PretrainedConfig, model_impl: ModelImpl) -> bool:
    """Whether `config`'s model runs on its native modules under `model_impl` (else on the transformers fallback);
    raises UnsupportedModelError, naming the feature, for a model the chosen implementation cannot run exactly."""
    native = architecture(config) in NATIVE_MODELS
    if model_impl == "native" and not native:
        raise UnsupportedModelError(
            config.model_type,
            f"--model-impl native (native modules exist for {', '.join(sorted(NATIVE_MODELS))}; this model is "
            f"{architecture(config)})",
        )
    use_native = native and (
        model_impl == "native" or (model_impl == "auto" and unsupported_feature(config, native=True) is None)
    )
    check_supported(config, native=use_native)
    return use_native


def choose_model_class(config: PretrainedConfig, model_impl: ModelImpl) -> type[CausalLM]:
    """The class that runs `config`'s model under `model_impl` (see `runs_native`)."""
    return MODELS[architecture(config) if runs_native(config, model_impl) else TRANSFORMERS]
