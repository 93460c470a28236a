"""What the engine checks as it starts: a KV cache that can hold one whole request, an attention backend that can run
the dtype, and the profiling step that sizes the cache on CUDA (run here on CPU, where only its memory reading
is skipped)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch

import engine.attention as attention
from engine.attention import TorchPagedBackend, select_backend
from engine.config import EngineConfig, EngineStartupError
from engine.core.engine_core import EngineCore
from engine.core.request import RequestRejected, SamplingParams
from engine.execution.cpu_threads import (
    FEW_SEQS,
    PREFILL_STEP_TOKENS,
    SHORT_PREFILL_TOKENS,
    decode_threads,
    step_threads,
)
from engine.execution.kv_caches import kv_cache_groups
from engine.execution.memory import largest_step_lengths, run_largest_step
from engine.models.loader import load_model, weight_bytes
from server.cli import add_serve_parser, build_engine_config


def test_a_cache_too_small_for_an_asked_max_model_len_refuses_to_start(tiny_llama: Path) -> None:
    config = EngineConfig.of(model=str(tiny_llama), num_pages=8, max_model_len=512)
    with pytest.raises(EngineStartupError) as info:
        EngineCore(config)
    message = str(info.value)
    assert "128 tokens" in message
    for flag in ("--max-model-len", "--num-pages", "--cpu-kv-cache-gib"):
        assert flag in message


def test_a_default_max_model_len_is_lowered_to_what_the_cache_holds(
    tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="engine.execution.startup"):
        engine = EngineCore(EngineConfig.of(model=str(tiny_llama), num_pages=8))
    assert engine.max_model_len == 8 * 16
    assert "max_model_len lowered to 128" in caplog.text
    # A request that leaves its length to the server now fits: the whole cache, not a refusal.
    engine.add_request("whole", [5, 6, 7], SamplingParams(max_new_tokens=engine.max_model_len - 3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(RequestRejected, match="maximum context length is 128"):
        engine.add_request("long", [5, 6, 7], SamplingParams(max_new_tokens=engine.max_model_len))


def test_a_cache_that_holds_the_model_length_keeps_it(tiny_llama: Path) -> None:
    assert EngineCore(EngineConfig.of(model=str(tiny_llama), num_pages=32, max_model_len=512)).max_model_len == 512


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
    config = EngineConfig.of(model=str(tiny_llama), max_batch_tokens=96, max_num_seqs=8, page_size=16)
    loaded = load_model(config)
    result = run_largest_step(config, loaded, kv_cache_groups(loaded.model, config.cache.page_size))
    assert [len(tokens) for tokens in result.token_ids] == [1] * 8
    assert all(lps is not None and [len(lp.top) for lp in lps] == [20] for lps in result.logprobs)


# -- CPU threads per step ------------------------------------------------------------------------------------


def test_prefill_threads_are_every_core_unless_asked_or_off(tiny_llama: Path) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    cores = len(os.sched_getaffinity(0))
    small = 2**20
    config = EngineConfig.of(model=str(tiny_llama), cpu_threads=1, cpu_prefill_threads=3)
    assert step_threads(config, cpu, small) == (1, 3)
    assert step_threads(config, cuda, small) is None, "a GPU step's threads only launch kernels"
    auto = EngineConfig.of(model=str(tiny_llama), cpu_threads=1)
    assert step_threads(auto, cpu, small) == ((1, cores) if cores > 1 else None)
    two_ranks = EngineConfig.of(model=str(tiny_llama), cpu_threads=1, tensor_parallel_size=2)
    assert step_threads(two_ranks, cpu, small) == ((1, cores // 2) if cores >= 4 else None), "a node's cores shared"
    same = EngineConfig.of(model=str(tiny_llama), cpu_threads=2, cpu_prefill_threads=2)
    assert step_threads(same, cpu, small) is None
    unset = EngineConfig.of(model=str(tiny_llama), cpu_threads=None, cpu_prefill_threads=4)
    assert step_threads(unset, cpu, small) is None
    with pytest.raises(ValueError, match="cpu_prefill_threads"):
        EngineConfig.of(model=str(tiny_llama), cpu_prefill_threads=0)


def test_an_engine_in_process_decodes_on_every_core_and_a_server_on_one(tiny_llama: Path) -> None:
    """The library's default (0) is every core the rank has, so one count for every step; `ferry serve`'s flag
    defaults to 1 (its front end takes the other core); a negative count is refused."""
    cores = len(os.sched_getaffinity(0))
    offline = EngineConfig.of(model=str(tiny_llama))
    assert offline.execution.cpu_threads == 0 and decode_threads(offline) == cores
    assert step_threads(offline, torch.device("cpu"), 2**20) is None, "no more prefill threads than decode threads"
    two_ranks = EngineConfig.of(model=str(tiny_llama), tensor_parallel_size=2)
    assert decode_threads(two_ranks) == max(1, cores // 2), "a node's cores shared among its ranks"
    assert decode_threads(EngineConfig.of(model=str(tiny_llama), cpu_threads=None)) is None
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    served = build_engine_config(parser.parse_args(["serve", "--model", str(tiny_llama)]))
    assert served.execution.cpu_threads == 1
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig.of(model=str(tiny_llama), cpu_threads=-1)


def test_a_large_model_runs_every_step_on_the_prefill_threads(tiny_llama: Path) -> None:
    cpu = torch.device("cpu")
    config = EngineConfig.of(model=str(tiny_llama), cpu_threads=1, cpu_prefill_threads=2, cpu_wide_model_bytes=1000)
    assert step_threads(config, cpu, 999) == (1, 2)
    assert step_threads(config, cpu, 1000) == (2, 2)
    off = EngineConfig.of(model=str(tiny_llama), cpu_threads=1, cpu_prefill_threads=2, cpu_wide_model_bytes=0)
    assert step_threads(off, cpu, 10**12) == (1, 2)
    with pytest.raises(ValueError, match="cpu_wide_model_bytes"):
        EngineConfig.of(model=str(tiny_llama), cpu_wide_model_bytes=-1)
    # Through the engine: the tiny model's weights against a bound at them and one just above.
    weights = weight_bytes(load_model(EngineConfig.of(model=str(tiny_llama))).model)
    for bound, expected in ((weights, 2), (weights + 1, 1)):
        wide = EngineConfig.of(model=str(tiny_llama), cpu_threads=1, cpu_prefill_threads=2, cpu_wide_model_bytes=bound)
        threads: list[int] = []
        with EngineCore(wide) as engine:
            engine.runner.model.register_forward_pre_hook(lambda *_, seen=threads: seen.append(torch.get_num_threads()))
            engine.add_request("r", [5, 6, 7], SamplingParams(max_new_tokens=3))
            while engine.has_unfinished():
                engine.step()
        assert threads == [expected] * 3, bound


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_step_of_prefill_size_runs_on_the_prefill_threads(tiny_llama: Path, async_scheduling: bool) -> None:
    config = EngineConfig.of(
        model=str(tiny_llama), cpu_threads=1, cpu_prefill_threads=2, async_scheduling=async_scheduling
    )
    threads: list[tuple[int, int]] = []  # (tokens, torch threads) of each forward pass
    with EngineCore(config) as engine:
        engine.runner.model.register_forward_pre_hook(
            lambda _, args: threads.append((args[0].shape[0], torch.get_num_threads()))
        )
        engine.add_request("long", list(range(3, 3 + PREFILL_STEP_TOKENS)), SamplingParams(max_new_tokens=3))
        engine.add_request("short", [5, 6, 7], SamplingParams(max_new_tokens=3))
        while engine.has_unfinished():
            engine.step()
    assert threads[0] == (PREFILL_STEP_TOKENS + 3, 2), "both prompts in one step: the prefill threads"
    assert threads[1:] and all(n == 1 for _, n in threads[1:]), "decode steps: cpu_threads"


def test_a_short_prompt_among_few_sequences_runs_on_the_prefill_threads(tiny_llama: Path) -> None:
    config = EngineConfig.of(model=str(tiny_llama), cpu_threads=1, cpu_prefill_threads=2, max_num_seqs=8)
    threads: list[tuple[int, int]] = []  # (tokens, torch threads) of each forward pass
    with EngineCore(config) as engine:
        engine.runner.model.register_forward_pre_hook(
            lambda _, args: threads.append((args[0].shape[0], torch.get_num_threads()))
        )
        # As many tokens, over one sequence too many: cpu_threads. Then one prompt of that size alone: the prefill
        # threads; then its decode steps: cpu_threads.
        many = FEW_SEQS + 1
        per_seq = -(-SHORT_PREFILL_TOKENS // many)
        for i in range(many):
            engine.add_request(f"many{i}", list(range(3, 3 + per_seq)), SamplingParams(max_new_tokens=1))
        while engine.has_unfinished():
            engine.step()
        engine.add_request("alone", list(range(3, 3 + SHORT_PREFILL_TOKENS)), SamplingParams(max_new_tokens=2))
        while engine.has_unfinished():
            engine.step()
    assert threads == [(many * per_seq, 1), (SHORT_PREFILL_TOKENS, 2), (1, 1)]
