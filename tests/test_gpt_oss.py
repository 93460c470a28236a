"""gpt-oss: its MXFP4 checkpoints served exactly (the experts dequantized as transformers loads them: a 4-bit value
times a power of two is exact in float32 and bfloat16). Attention sinks and its alternating sliding windows run
through the adapter in tests/test_engine_equivalence.py."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Mxfp4Config

from engine import EngineConfig, EngineCore, UnsupportedModelError
from engine.models.hf_adapter import TransformersCausalLM
from engine.quantization import UnsupportedQuantization
from tests.model_factory import build_model_dir
from tests.mxfp4 import write_mxfp4_pair
from tests.test_engine_equivalence import CONFIGS, LOGPROB_TOLERANCE, _prompts, _run, generate_alone


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a gpt-oss directory in float32, the same weights with MXFP4 experts)."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    plain = build_model_dir(root / "plain", "gpt_oss")
    write_mxfp4_pair(plain, root / "mxfp4")
    return plain, root / "mxfp4"


def test_the_packed_experts_are_what_transformers_dequantizes(checkpoints: tuple[Path, Path]) -> None:
    plain, mxfp4 = checkpoints
    want = dict(AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).named_parameters())
    loaded = AutoModelForCausalLM.from_pretrained(
        mxfp4, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    )
    got = dict(loaded.named_parameters())
    assert got.keys() == want.keys()
    experts = [name for name in want if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(experts) == 2 * loaded.config.num_hidden_layers
    assert all(torch.equal(got[name], want[name]) for name in want)


@pytest.mark.parametrize("setup", ["mixed", "chunked", "preempt"])
def test_an_mxfp4_checkpoint_serves_its_dequantized_weights_exactly(checkpoints: tuple[Path, Path], setup: str) -> None:
    plain, mxfp4 = checkpoints
    hf = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
    prompts, max_new = _prompts(hf.config.vocab_size)
    expected, expected_logprobs = generate_alone(hf, prompts, max_new)
    engine, outputs, logprobs, _ = _run(mxfp4, prompts, max_new, **CONFIGS[setup])
    assert isinstance(engine.runner.model, TransformersCausalLM)
    assert engine.checkpoint_quantization is not None and engine.checkpoint_quantization[0] == "mxfp4"
    for i, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        assert got == want, f"{setup}: request {i} diverged"
        worst = max(abs(a - b) for a, b in zip(logprobs[i], expected_logprobs[i], strict=True))
        assert worst <= LOGPROB_TOLERANCE, f"{setup}: request {i}: a logprob is {worst:.2e} off"
    assert engine.is_idle_and_clean()


def test_mxfp4_outside_gpt_oss_is_refused_by_name(model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    path = tmp_path / "llama-mxfp4"
    shutil.copytree(model_dir("llama"), path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantization, match="MXFP4 weights are served for gpt-oss only"):
        EngineCore(EngineConfig.of(model=str(path), num_pages=64))
    with pytest.raises(UnsupportedModelError, match="a quantized checkpoint on the transformers adapter"):
        EngineCore(EngineConfig.of(model=str(path), num_pages=64, model_impl="transformers"))
