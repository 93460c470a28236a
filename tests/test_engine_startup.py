"""What the engine checks as it starts: a KV cache that can hold one whole request, an attention backend that can run
the dtype, and the profiling step that sizes the cache on CUDA (run here on CPU, where only its memory reading
is skipped)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine.attention as attention
from engine.attention import TorchPagedBackend, select_backend
from engine.config import EngineConfig, EngineStartupError
from engine.core import EngineCore
from engine.kv_cache import group_layers
from engine.loader import load_model
from engine.memory import largest_step_lengths, run_largest_step
from engine.request import RequestRejected, SamplingParams


def test_a_cache_too_small_for_an_asked_max_model_len_refuses_to_start(tiny_llama: Path) -> None:
    config = EngineConfig(model=str(tiny_llama), num_blocks=8, max_model_len=512)
    with pytest.raises(EngineStartupError) as info:
        EngineCore(config)
    message = str(info.value)
    assert "128 tokens" in message
    for flag in ("--max-model-len", "--num-blocks", "--cpu-kv-cache-gib"):
        assert flag in message


def test_a_default_max_model_len_is_lowered_to_what_the_cache_holds(
    tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="engine.core"):
        engine = EngineCore(EngineConfig(model=str(tiny_llama), num_blocks=8))
    assert engine.max_model_len == 8 * 16
    assert "max_model_len lowered to 128" in caplog.text
    # A request that leaves its length to the server now fits: the whole cache, not a refusal.
    engine.add_request("whole", [5, 6, 7], SamplingParams(max_new_tokens=engine.max_model_len - 3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(RequestRejected, match="maximum context length is 128"):
        engine.add_request("long", [5, 6, 7], SamplingParams(max_new_tokens=engine.max_model_len))


def test_a_cache_that_holds_the_model_length_keeps_it(tiny_llama: Path) -> None:
    assert EngineCore(EngineConfig(model=str(tiny_llama), num_blocks=32, max_model_len=512)).max_model_len == 512


def test_flash_attention_with_float32_is_refused_when_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="float16 or bfloat16 only"):
        select_backend("flash", "cuda", 256, torch.float32)
    # auto passes flash-attn over for float32: to the Triton kernel where triton is installed
    # (tests/test_triton_attention.py), else to the torch backend.
    monkeypatch.setattr(attention, "_triton_installed", lambda: False)
    assert isinstance(select_backend("auto", "cuda", 256, torch.float32), TorchPagedBackend)


def test_largest_step_fills_the_token_budget_over_the_most_sequences() -> None:
    assert largest_step_lengths(2048, 256, 512) == [512, 512, 512, 260] + [1] * 252
    assert largest_step_lengths(16, 256, 512) == [1] * 16
    assert largest_step_lengths(100, 4, 512) == [97, 1, 1, 1]
    for lengths in (largest_step_lengths(2048, 256, 512), largest_step_lengths(300, 7, 50)):
        assert max(lengths) <= 512 and sum(lengths) <= 2048


def test_the_profiling_step_runs_through_a_runner(tiny_llama: Path) -> None:
    config = EngineConfig(model=str(tiny_llama), max_batch_tokens=96, max_num_seqs=8, page_size=16)
    loaded = load_model(config)
    result = run_largest_step(config, loaded, group_layers(loaded.model.sliding_windows))
    assert len(result.token_ids) == 8
    assert all(logprob is not None and len(logprob.top) == 20 for logprob in result.logprobs)
