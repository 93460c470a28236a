"""engine/models/registry.py: a registered architecture picks its class, any other the transformers fallback, and
`--model-impl` forces either way (refusing, by name, what the native modules cannot run)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from transformers import AutoConfig

from engine.models.base import CausalLM
from engine.models.hf_adapter import TransformersCausalLM
from engine.models.llama import LlamaFamilyForCausalLM
from engine.models.registry import MODELS, NATIVE_MODELS, TRANSFORMERS, VISION_MODELS, architecture, choose_model_class
from engine.models.support import UnsupportedModelError
from tests.server_harness import REPO_ROOT


def _config(model_type: str, **overrides: object) -> AutoConfig:
    return AutoConfig.for_model(model_type, **overrides)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
def test_a_registered_architecture_picks_its_class(model_type: str) -> None:
    config = _config(model_type)
    assert architecture(config) in NATIVE_MODELS
    assert choose_model_class(config, "auto") is LlamaFamilyForCausalLM
    assert choose_model_class(config, "native") is LlamaFamilyForCausalLM
    assert choose_model_class(config, "transformers") is TransformersCausalLM


def test_the_architecture_comes_from_config_architectures() -> None:
    config = _config("llama", architectures=["Qwen3ForCausalLM"])
    assert architecture(config) == "Qwen3ForCausalLM"


def test_an_unknown_architecture_takes_the_fallback_and_native_refuses_it() -> None:
    config = _config("gpt2")
    assert choose_model_class(config, "auto") is MODELS[TRANSFORMERS] is TransformersCausalLM
    with pytest.raises(UnsupportedModelError, match="--model-impl native"):
        choose_model_class(config, "native")


def test_auto_sends_a_feature_the_native_modules_lack_to_the_fallback() -> None:
    config = _config("llama", hidden_act="gelu")
    assert choose_model_class(config, "auto") is TransformersCausalLM
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        choose_model_class(config, "native")


def test_every_registered_class_has_the_protocol_methods() -> None:
    methods = ("forward", "compute_logits", "load_weights", "cache_specs", "attention_needs")
    assert all(hasattr(CausalLM, m) for m in methods)
    for cls in MODELS.values():
        assert all(callable(getattr(cls, m, None)) for m in methods), cls


def test_every_image_model_path_resolves_to_a_class() -> None:
    for name, cls in VISION_MODELS.items():
        assert isinstance(cls, type) and name.endswith("ForConditionalGeneration"), name


def test_asking_whether_an_architecture_is_native_imports_nothing() -> None:
    """The registry's classes load when looked up, and only then: `in` must not import a family's module (a hybrid
    family's imports transformers' modelling machinery, seconds of an engine's start)."""
    done = subprocess.run(
        [sys.executable, "-c", "import sys\nfrom engine.models.registry import NATIVE_MODELS\n"
         "assert 'JambaForCausalLM' in NATIVE_MODELS and 'GPT2LMHeadModel' not in NATIVE_MODELS\n"
         "print('engine.models.hybrid' in sys.modules, 'engine.models.llama' in sys.modules)"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    assert done.stdout.split() == ["False", "False"]
