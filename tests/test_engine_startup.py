"""What the engine checks as it starts: a KV cache that can hold one whole request, an attention backend that can run
the dtype, and the profiling step that sizes the cache on CUDA (run here on CPU, where only its memory reading
is skipped)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import engine.attention as attention
from engine.attention import TorchPagedBackend, select_backend
from engine.config import EngineConfig, EngineStartupError
from engine.core.engine_core import EngineCore
from engine.core.request import RequestRejected, SamplingParams
from engine.execution.cpu_threads import (
    FEW_SEQS,
    HELPER_MIN_TOKENS,
    LOAD_WINDOW_SECONDS,
    PREFILL_SHARED_LOAD,
    PREFILL_STEP_TOKENS,
    SHORT_PREFILL_TOKENS,
    FreeCores,
    StepThreads,
    busy_ticks,
    decode_threads,
    free_cores,
    step_threads,
)
from engine.execution.kv_caches import kv_cache_groups
from engine.execution.memory import largest_step_lengths, run_largest_step
from engine.kernels.library import cpu_kernels_available, linear_helper_on, set_linear_helper
from engine.models.loader import load_model
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
    config = EngineConfig.of(model=str(tiny_llama), cpu_threads=1, cpu_prefill_threads=3)
    assert step_threads(config, cpu) == (1, 3, None)
    assert step_threads(config, cuda) is None, "a GPU step's threads only launch kernels"
    auto = step_threads(EngineConfig.of(model=str(tiny_llama), cpu_threads=1), cpu)
    assert auto is None if cores == 1 else auto[:2] == (1, 0) and isinstance(auto.free, FreeCores)
    two_ranks = step_threads(EngineConfig.of(model=str(tiny_llama), cpu_threads=1, tensor_parallel_size=2), cpu)
    assert two_ranks is None if cores < 4 else two_ranks.free is not None and two_ranks.free.rank_cores == cores // 2
    same = EngineConfig.of(model=str(tiny_llama), cpu_threads=2, cpu_prefill_threads=2)
    assert step_threads(same, cpu) is None
    unset = EngineConfig.of(model=str(tiny_llama), cpu_threads=None, cpu_prefill_threads=4)
    assert step_threads(unset, cpu) is None
    with pytest.raises(ValueError, match="cpu_prefill_threads"):
        EngineConfig.of(model=str(tiny_llama), cpu_prefill_threads=0)


def test_decode_threads_follow_the_load_by_default_in_process_and_served(tiny_llama: Path) -> None:
    """0 and None, the defaults of the library and of `ferry serve`: the free cores, any count down to one;
    compiled, every core or one fewer (a graph per count); a negative count is refused."""
    cores = len(os.sched_getaffinity(0))
    offline = EngineConfig.of(model=str(tiny_llama))
    assert offline.execution.cpu_threads == 0 and decode_threads(offline) == cores
    threads = step_threads(offline, torch.device("cpu"))
    compiled = step_threads(EngineConfig.of(model=str(tiny_llama), compile="piecewise"), torch.device("cpu"))
    if cores == 1:
        assert threads is None and compiled is None, "one core: nothing to follow"
    else:
        assert isinstance(threads, StepThreads) and threads[:2] == (0, 0) and threads.free is not None
        assert list(threads.free.counts()) == list(range(cores, 0, -1))
        assert isinstance(compiled, StepThreads) and compiled.free is not None
        assert list(compiled.free.counts()) == [cores, cores - 1]
    two_ranks = EngineConfig.of(model=str(tiny_llama), tensor_parallel_size=2)
    assert decode_threads(two_ranks) == max(1, cores // 2), "a node's cores shared among its ranks"
    assert decode_threads(EngineConfig.of(model=str(tiny_llama), cpu_threads=None)) is None
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    served = build_engine_config(parser.parse_args(["serve", "--model", str(tiny_llama)]))
    assert served.execution.cpu_threads == 0
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig.of(model=str(tiny_llama), cpu_threads=-1)


def test_free_cores_are_those_the_others_leave() -> None:
    assert [free_cores(load, 2, 2) for load in (0.0, 0.3, 0.31, 1.0, 1.3, 1.31, 9.0)] == [2, 2, 1, 1, 1, 1, 1]
    assert [free_cores(load, 16, 16) for load in (0.2, 0.8, 3.2)] == [16, 15, 13]
    # Two ranks of 8 on 16 cores: the other rank's 8 busy cores leave this one its share.
    assert [free_cores(load, 16, 8) for load in (0.0, 8.0, 8.4)] == [8, 8, 7]
    # A prefill shares a core with more of a load (that of processes other than the front end, which waits for it).
    assert [free_cores(load, 2, 2, PREFILL_SHARED_LOAD) for load in (0.3, 0.6, 0.61, 1.0)] == [2, 2, 1, 1]


@given(
    others=st.floats(0, 64, allow_nan=False),
    more=st.floats(0, 64, allow_nan=False),
    cores=st.integers(1, 64),
    ranks=st.integers(1, 8),
)
def test_free_cores_are_at_least_one_at_most_the_share_and_fewer_as_load_grows(
    others: float, more: float, cores: int, ranks: int
) -> None:
    share = max(1, cores // ranks)
    count = free_cores(others, cores, share)
    assert 1 <= count <= share
    assert free_cores(others + more, cores, share) <= count
    assert count <= free_cores(others, cores, share, PREFILL_SHARED_LOAD), "a prefill gives up a core last"


def test_busy_ticks_count_the_processs_cpus_without_idle_or_io_wait() -> None:
    stat = (
        "cpu  40 2 10 500 9 4 6 8 0 0\n"
        "cpu0 10 1 5 200 7 2 3 4 0 0\n"
        "cpu1 30 1 5 300 2 2 3 4 0 0\n"
        "cpu12 100 0 0 0 0 0 0 0 0 0\n"
        "intr 12345 0 0\nctxt 999\n"
    )
    assert busy_ticks(stat, {0}) == 10 + 1 + 5 + 2 + 3 + 4
    assert busy_ticks(stat, {0, 1}) == 25 + 30 + 1 + 5 + 2 + 3 + 4
    assert busy_ticks(stat, {1, 12}) == 45 + 100
    assert busy_ticks(stat, set()) == 0
    assert busy_ticks(stat) == 25 + 45 + 100, "every CPU's line, the machine's total line left out"


class _Machine:
    """A machine's busy time, a clock, the engine's own CPU time and its parent's, which a test moves by hand."""

    def __init__(self) -> None:
        self.now, self.busy, self.own, self.parent = 100.0, 0.0, 0.0, 0.0

    def run(self, seconds: float, busy_cores: float, own_cores: float, parent_cores: float = 0.0) -> None:
        self.now += seconds
        self.busy += seconds * busy_cores
        self.own += seconds * own_cores
        self.parent += seconds * parent_cores

    def free_cores(self, fewest: int = 1) -> FreeCores:
        return FreeCores(
            2,
            2,
            lambda: self.busy,
            fewest,
            clock=lambda: self.now,
            own_seconds=lambda: self.own,
            parent_seconds=lambda: self.parent,
        )


def test_free_cores_are_measured_once_a_window_over_it() -> None:
    machine = _Machine()
    free = machine.free_cores()
    machine.run(LOAD_WINDOW_SECONDS / 2, busy_cores=2.0, own_cores=0.5)
    assert free.count(large=False) == 2, "every core until a window has passed"
    machine.run(LOAD_WINDOW_SECONDS, busy_cores=1.5, own_cores=1.0)
    assert free.count(large=False) == 1, "the others kept 0.83 cores busy since it started"
    machine.run(LOAD_WINDOW_SECONDS / 2, busy_cores=1.0, own_cores=1.0)
    assert free.count(large=False) == 1, "not measured again within the window"
    machine.run(LOAD_WINDOW_SECONDS, busy_cores=1.2, own_cores=1.0)
    assert free.count(large=False) == 1, "the others went quiet (0.13 cores since): one quiet window"
    machine.run(LOAD_WINDOW_SECONDS, busy_cores=1.2, own_cores=1.1)
    assert free.count(large=False) == 2, "two quiet windows"
    free.pinned = 2
    machine.run(LOAD_WINDOW_SECONDS, busy_cores=2.0, own_cores=0.5)
    assert free.count(large=False) == 2, "pinned"
    free.pinned = None
    assert free.count(large=False) == 1
    floor = machine.free_cores(fewest=2)
    machine.run(LOAD_WINDOW_SECONDS, busy_cores=2.0, own_cores=0.0)
    assert (floor.count(large=False), free.count(large=False)) == (2, 1), "never below its fewest"


def test_a_prefill_leaves_a_core_to_a_busy_process_but_not_to_the_front_end_that_waits_for_it() -> None:
    machine = _Machine()
    free = machine.free_cores()
    machine.run(LOAD_WINDOW_SECONDS, busy_cores=2.0, own_cores=1.0, parent_cores=0.5)
    assert (free.count(large=False), free.count(large=True)) == (1, 2), "the parent's 0.5 and 0.5 more"
    machine.run(LOAD_WINDOW_SECONDS, busy_cores=2.0, own_cores=1.3, parent_cores=0.0)
    assert (free.count(large=False), free.count(large=True)) == (1, 1), "0.7 cores of a process apart"
    machine.run(LOAD_WINDOW_SECONDS, busy_cores=1.4, own_cores=1.0, parent_cores=0.3)
    assert (free.count(large=False), free.count(large=True)) == (1, 2), "0.4, the parent's 0.3 of it"


@pytest.mark.skipif(not cpu_kernels_available(), reason="the CPU kernels cannot be built here")
def test_a_core_left_to_the_others_gets_the_linear_helper_while_the_threads_follow_the_load() -> None:
    """The blocked linears' helper thread (engine/kernels/helping.h) works in the idle time of the cores a step
    leaves out: on while a step that follows the load runs on fewer threads than the rank's cores, off when it takes
    them all or its count is fixed."""
    machine = _Machine()
    following = StepThreads(0, 0, machine.free_cores())
    threads = torch.get_num_threads()
    try:
        machine.run(LOAD_WINDOW_SECONDS, busy_cores=1.0, own_cores=1.0)
        assert following.use_for(1, 1) == 2 and not linear_helper_on(), "a quiet machine: every core, no helper"
        machine.run(LOAD_WINDOW_SECONDS, busy_cores=2.0, own_cores=1.0)
        assert following.use_for(HELPER_MIN_TOKENS, HELPER_MIN_TOKENS) == 1 and linear_helper_on(), "a busy front end"
        assert following.use_for(HELPER_MIN_TOKENS - 1, 1) == 1 and not linear_helper_on(), "a lone stream: no helper"
        assert StepThreads(1, 0, machine.free_cores()).use_for(1, 1) == 1 and not linear_helper_on(), "fixed count"
    finally:
        set_linear_helper(False)
        torch.set_num_threads(threads)


def _busy_process() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not Path("/proc/stat").exists(), reason="one core, or no /proc")
def test_a_busy_process_beside_the_engine_takes_a_decode_thread(tiny_llama: Path) -> None:
    """Measured from this machine's /proc/stat: a process spinning beside an engine that follows the load leaves its
    steps, decodes and prefills alike, one core fewer."""
    cores = len(os.sched_getaffinity(0))
    busy = _busy_process()
    try:
        with EngineCore(EngineConfig.of(model=str(tiny_llama))) as engine:
            threads: list[tuple[int, int]] = []  # (tokens, torch threads) of each forward pass
            engine.runner.model.register_forward_pre_hook(
                lambda _, args: threads.append((args[0].shape[0], torch.get_num_threads()))
            )
            time.sleep(LOAD_WINDOW_SECONDS * 1.5)  # a window of the busy process
            engine.add_request("r", list(range(3, 3 + PREFILL_STEP_TOKENS)), SamplingParams(max_new_tokens=4))
            while engine.has_unfinished():
                engine.step()
    finally:
        busy.kill()
        busy.wait()
    assert threads[0][0] == PREFILL_STEP_TOKENS and len(threads) == 4, threads
    assert all(n <= cores - 1 for _, n in threads), threads


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
