"""engine/layers/rotary.py's tables against transformers' own rotary modules, for every rope type a config names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from engine.layers.rotary import LlamaRotary, rotary_tables
from engine.models.config_record import RecordedConfig, load_config

ROPE_PARAMETERS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + i / 16 for i in range(16)],
        "long_factor": [2.0 + i / 8 for i in range(16)],
        "original_max_position_embeddings": 64,
    },
}


def _config(rope: dict[str, object]) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        max_position_embeddings=256,
        rope_parameters={"rope_theta": 10000.0, **rope},
    )


@pytest.mark.parametrize("rope_type", sorted(ROPE_PARAMETERS))
@pytest.mark.parametrize("max_positions", [48, 512])  # within, and beyond, the lengths the scalings switch at
def test_tables_equal_transformers_llama_rotary(rope_type: str, max_positions: int) -> None:
    config = _config(ROPE_PARAMETERS[rope_type])
    cos, sin = rotary_tables(config, max_positions, torch.float32)
    expected_cos, expected_sin = rotary_tables(config, max_positions, torch.float32, LlamaRotaryEmbedding)
    assert cos.shape == (max_positions, 32)
    assert torch.equal(cos, expected_cos)
    assert torch.equal(sin, expected_sin)


def test_scaling_is_applied() -> None:
    """The comparison above could pass with a module that ignored scaling: the scaled tables differ from unscaled."""
    default = rotary_tables(_config(ROPE_PARAMETERS["default"]), 128, torch.float32)[0]
    for rope_type in ("linear", "yarn", "llama3", "longrope"):
        assert not torch.equal(rotary_tables(_config(ROPE_PARAMETERS[rope_type]), 128, torch.float32)[0], default)


def test_module_keeps_transformers_buffers() -> None:
    """dynamic_rope_update reads and rewrites these names on the module."""
    rotary = LlamaRotary(_config(ROPE_PARAMETERS["dynamic"]))
    assert {name for name, _ in rotary.named_buffers()} == {"inv_freq", "original_inv_freq"}
    assert rotary.max_seq_len_cached == rotary.original_max_seq_len == 256


def test_tables_on_the_meta_device_have_the_shape_of_real_ones() -> None:
    config = _config(ROPE_PARAMETERS["yarn"])
    with torch.device("meta"):
        cos, sin = rotary_tables(config, 300, torch.bfloat16)
    expected = rotary_tables(config, 300, torch.bfloat16)[0]
    for table in (cos, sin):
        assert table.device.type == "meta"
        assert (table.shape, table.dtype) == (expected.shape, expected.dtype)


@pytest.mark.parametrize("rope_type", sorted(ROPE_PARAMETERS))
def test_a_recorded_config_gives_the_same_tables(
    rope_type: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A warm start's config (engine/models/config_record.py) holds values only; transformers' rope functions, which
    the scaled types go through, take it as they take the original."""
    monkeypatch.setenv("FERRY_CACHE_DIR", str(tmp_path / "cache"))
    config = _config(ROPE_PARAMETERS[rope_type])
    config.save_pretrained(tmp_path / "model")
    load_config(str(tmp_path / "model"))
    recorded = load_config(str(tmp_path / "model"))
    assert isinstance(recorded, RecordedConfig)
    cos, sin = rotary_tables(recorded, 512, torch.float32)
    expected_cos, expected_sin = rotary_tables(config, 512, torch.float32, LlamaRotaryEmbedding)
    assert torch.equal(cos, expected_cos)
    assert torch.equal(sin, expected_sin)
