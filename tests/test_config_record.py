"""The recorded config (engine/models/config_record.py): a start that finds a record rebuilds exactly the config
`AutoConfig` returned, attribute for attribute, aliases included; what a record cannot hold exactly is not recorded,
and a record that cannot be read sends the start back to `AutoConfig`."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from engine import EngineConfig, EngineCore, SamplingParams, generate_batch
from engine.models.config_record import RecordedConfig, config_record, load_config
from engine.models.loader import load_model
from tests.server_harness import REPO_ROOT

DEMO = REPO_ROOT / "server" / "default_model"
PROMPTS = [[1, 17, 300, 45, 9], [1, 2048, 7, 7, 7, 7, 1000]]

# Each native family's config class, small, with what distinguishes it (MoE counts, latent attention's ranks, rope
# scaling, sliding windows, layer types, a dtype, aliases such as Mixtral's num_experts).
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        }
    },
    "qwen2": {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1},
    "qwen3": {"head_dim": 48},
    "mistral": {"sliding_window": 16},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "shared_expert_intermediate_size": 32},
    "qwen3_moe": {"num_experts": 4, "decoder_sparse_step": 2},
    "gpt_oss": {"num_local_experts": 4, "layer_types": ["sliding_attention", "full_attention"]},
    "deepseek_v3": {
        "q_lora_rank": 16,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "n_routed_experts": 4,
        "first_k_dense_replace": 1,
    },
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    # Properties computed from fields (`layer_types`, Jamba's `layers_block_type`): recorded as their values.
    "mamba": {"state_size": 8},
    "jamba": {
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "num_experts": 4,
    },
}
SMALL = {
    "vocab_size": 64,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "dtype": "bfloat16",
}


def _answers(config: PretrainedConfig) -> dict[str, Any]:
    """Every value `config` answers for (AttributeError where it raises): instance and class attributes, the base
    class's properties (deprecated names included), and aliases."""
    names = {name for name in dir(config) if not name.startswith("__")} | set(config.attribute_map)
    values = {}
    for name in names - {"per_layer_config"}:  # a view made anew on each read
        value = getattr(config, name, AttributeError)  # a property of what the config lacks raises
        if value is AttributeError or not callable(value):
            values[name] = value
    return values


@pytest.fixture(autouse=True)
def _cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FERRY_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_recorded_config_answers_as_the_original(model_type: str, tmp_path: Path) -> None:
    directory = str(tmp_path / model_type)
    AutoConfig.for_model(model_type, **{**SMALL, **FAMILIES[model_type]}).save_pretrained(directory)
    expected = AutoConfig.from_pretrained(directory)
    first = load_config(directory)
    assert type(first) is type(expected)
    assert config_record(directory).stat().st_mode & 0o777 == 0o644  # readable by a shared cache's other users
    warm = load_config(directory)
    assert isinstance(warm, RecordedConfig)
    assert {name: getattr(warm, name, AttributeError) for name in _answers(expected)} == _answers(expected)
    assert warm.dtype is torch.bfloat16
    for alias, name in type(expected).attribute_map.items():
        assert getattr(warm, alias) == getattr(expected, name)


def test_an_image_models_nested_configs_are_not_recorded(tmp_path: Path) -> None:
    directory = str(tmp_path / "llava")
    AutoConfig.for_model("llava").save_pretrained(directory)
    load_config(directory)
    assert not config_record(directory).exists()
    assert type(load_config(directory)).__name__ == "LlavaConfig"


def test_a_recorded_config_follows_its_aliases_and_names_what_it_lacks(tmp_path: Path) -> None:
    directory = str(tmp_path / "mixtral")
    AutoConfig.for_model("mixtral", **SMALL, num_local_experts=4).save_pretrained(directory)
    load_config(directory)
    warm = load_config(directory)
    assert isinstance(warm, RecordedConfig)
    warm.num_experts = 8  # an alias (Mixtral's attribute_map): written through to the field
    assert warm.num_local_experts == 8
    assert warm.torch_dtype is warm.dtype is torch.bfloat16  # the base class's deprecated name
    assert warm.transformers_has_causal_lm
    with pytest.raises(AttributeError, match="'mixtral' config has no attribute 'no_such_field'"):
        warm.no_such_field  # noqa: B018


def test_what_the_config_depends_on_is_in_the_key(tmp_path: Path) -> None:
    directory = tmp_path / "model"
    shutil.copytree(DEMO, directory)
    record = config_record(str(directory))
    config = json.loads((directory / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (directory / "config.json").write_text(json.dumps(config))
    assert config_record(str(directory)) != record
    moved = tmp_path / "moved"
    shutil.copytree(directory, moved)
    assert config_record(str(moved)) != config_record(str(directory))  # the path is the config's _name_or_path
    load_config(str(directory))
    assert load_config(str(directory)).rms_norm_eps == 1e-5


@pytest.mark.parametrize(
    "broken", ["not json", '{"state": {"dict": []}}', '{"class_attributes": {"set": []}, "state": 1}']
)
def test_an_unreadable_record_is_replaced(broken: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    directory = str(tmp_path / "model")
    shutil.copytree(DEMO, directory)
    record = config_record(directory)
    record.parent.mkdir(parents=True)
    record.write_text(broken)
    with caplog.at_level(logging.WARNING):
        config = load_config(directory)
    assert type(config).__name__ == "LlamaConfig"
    assert "Ignoring the record" in caplog.text or "Ignoring the config record" in caplog.text
    assert isinstance(load_config(directory), RecordedConfig)


def _generates_the_same_from_its_record(directory: str, prompts: list[list[int]], **options: Any) -> None:
    """Serve `directory` twice, the first engine on AutoConfig's config, the second on the record the first wrote:
    the same greedy tokens and logprobs."""
    params = SamplingParams(max_new_tokens=24, logprobs=True, top_logprobs=2)
    outputs = []
    for _ in range(2):
        engine = EngineCore(EngineConfig.of(model=directory, **options))
        try:
            outputs.append(generate_batch(prompts, params=params, engine=engine))
        finally:
            engine.close()
    assert isinstance(load_config(directory), RecordedConfig)
    for name, first in outputs[0].items():
        assert outputs[1][name].generated_ids == first.generated_ids
        assert outputs[1][name].logprobs == first.logprobs


def test_a_model_loaded_from_its_record_generates_the_same(tmp_path: Path) -> None:
    directory = str(tmp_path / "model")
    shutil.copytree(DEMO, directory)
    _generates_the_same_from_its_record(directory, PROMPTS)


@pytest.mark.parametrize(
    ("model_type", "options"),
    [
        ("llama", {"model_impl": "transformers"}),  # the fallback
        ("bert", {"runner": "pooling"}),  # an encoder
    ],
)
def test_transformers_model_classes_get_transformers_config_class(
    model_type: str, options: dict[str, str], tmp_path: Path
) -> None:
    """The paths that hand the config to transformers' model classes (`from_config`, which takes its own classes
    only) read a recorded config again through AutoConfig."""
    directory = str(tmp_path / model_type)
    small = {key: SMALL[key] for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")}
    AutoConfig.for_model(model_type, **small, num_attention_heads=4).save_pretrained(directory)
    config = EngineConfig.of(model=directory, load_format="dummy", **options)
    for _ in range(2):
        loaded = load_model(config)
        assert type(loaded.hf_config) is type(AutoConfig.from_pretrained(directory))
    assert isinstance(load_config(directory), RecordedConfig)


GENERATING = sorted(set(FAMILIES) - {"qwen3_moe", "deepseek_v3"})
"""The families above whose small config here also builds a model that runs (those two need more fields set; their
configs are compared value for value above)."""


@pytest.mark.parametrize("model_type", GENERATING)
def test_each_family_generates_the_same_from_its_record(model_type: str, tmp_path: Path) -> None:
    """Random weights saved by transformers, served twice: the first engine on AutoConfig's config, the second on
    the recorded one; the same greedy tokens and logprobs."""
    directory = tmp_path / model_type
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**SMALL, **FAMILIES[model_type], "dtype": "float32"})
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    _generates_the_same_from_its_record(str(directory), [[1, 5, 9, 12]], max_model_len=64)
