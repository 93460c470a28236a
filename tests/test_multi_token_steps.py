"""Several tokens per request per step, end to end: a scripted runner returns, for some requests, the model's own
greedy continuation (from transformers' `generate`) after the token it sampled, as if drafted and accepted. The
engine must then produce exactly plain greedy decoding, under chunked prefill, preemption, prefix sharing, async
scheduling and tensor parallelism: the returned tokens cut by the stop rules, their K/V computed by later steps.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine import EngineConfig, EngineCore, SamplingParams, generate_batch
from engine.core.observer import StepRecord
from engine.core.request import TokenLogprob
from engine.execution.runner import ModelRunner, StepInputs
from engine.sampling.sampler import SampleResult
from tests.test_engine_equivalence import CONFIGS, LOGPROB_TOLERANCE, _reference

EXTRA_TOKENS = 3
"""Tokens a scripted request gets after its sampled one, each step."""


class ScriptedRunner(ModelRunner):
    """The real runner, except that every other prompt gets `EXTRA_TOKENS` more tokens after each sampled one:
    the reference's greedy continuation, with the reference's logprobs."""

    continuations: dict[tuple[int, ...], tuple[list[int], list[float]]]
    num_multi_token_results: int

    def step_tokens(
        self, inputs: StepInputs, sampled: SampleResult
    ) -> tuple[list[list[int]], list[list[TokenLogprob] | None]]:
        token_ids, logprobs = super().step_tokens(inputs, sampled)
        for row, (seq, position) in enumerate(zip(inputs.sampling, inputs.sample_positions, strict=True)):
            scripted = self.continuations.get(seq.prompt_ids)
            if scripted is None:
                continue
            tokens, token_logprobs = scripted
            index = position - len(seq.prompt_ids)
            extra = range(index + 1, min(index + 1 + EXTRA_TOKENS, len(tokens)))
            if not extra or token_ids[row][0] != tokens[index]:
                continue  # past the reference (the length stop cuts it), or diverged: the test fails on the output
            token_ids[row] += [tokens[k] for k in extra]
            entries = logprobs[row]
            if entries is not None:
                entries += [TokenLogprob(tokens[k], token_logprobs[k]) for k in extra]
            self.num_multi_token_results += 1
        return token_ids, logprobs


class _MostTokens:
    """The most tokens any request got from one step."""

    def __init__(self) -> None:
        self.most = 0

    def on_step(self, record: StepRecord) -> None:
        self.most = max([self.most, *(len(output.new_token_ids) for output in record.outputs)])


def _scripted_run(path: Path, arch: str, shared_prefix: int, **overrides: object) -> tuple[EngineCore, int]:
    """Runs the reference prompts through a scripted engine; asserts tokens and logprobs equal the reference."""
    prompts, max_new, expected, expected_logprobs = _reference(path, arch, shared_prefix)
    watch = _MostTokens()
    config = EngineConfig.of(model=str(path), debug_checks=True, **{"num_pages": 512, **overrides})  # type: ignore[arg-type]
    engine = EngineCore(config, observers=[watch], runner_class=ScriptedRunner)
    runner = engine.runner
    assert isinstance(runner, ScriptedRunner)
    runner.continuations = {tuple(prompts[i]): (expected[i], expected_logprobs[i]) for i in range(0, len(prompts), 2)}
    runner.num_multi_token_results = 0
    params = [SamplingParams(max_new_tokens=n, logprobs=True) for n in max_new]
    results = generate_batch(prompts, params=params, engine=engine)
    for i, want in enumerate(expected):
        got = results[f"req_{i}"]
        assert got.generated_ids == want, f"request {i} (prompt {len(prompts[i])} tokens) diverged"
        assert got.logprobs is not None and len(got.logprobs) == len(want)
        worst = max(abs(t.logprob - e) for t, e in zip(got.logprobs, expected_logprobs[i], strict=True))
        assert worst <= LOGPROB_TOLERANCE, f"request {i}: a logprob is {worst:.2e} off"
    assert runner.num_multi_token_results > 0 and watch.most > 1, "no step returned several tokens"
    assert engine.is_idle_and_clean()
    engine.kv_cache.check_invariants()
    return engine, runner.num_multi_token_results


@pytest.mark.parametrize("arch", ["llama", "qwen2_hybrid"])
@pytest.mark.parametrize("setup", ["mixed", "chunked", "preempt"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_several_tokens_a_step_equal_greedy_decoding(
    model_dir: Callable[[str], Path], arch: str, setup: str, async_scheduling: bool
) -> None:
    engine, _ = _scripted_run(model_dir(arch), arch, 0, async_scheduling=async_scheduling, **CONFIGS[setup])
    if setup == "preempt":
        assert engine.scheduler.num_preemptions > 0
    engine.close()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_several_tokens_a_step_with_a_shared_prefix(model_dir: Callable[[str], Path], async_scheduling: bool) -> None:
    engine, _ = _scripted_run(
        model_dir("llama"), "llama", 40, async_scheduling=async_scheduling, max_batch_tokens=64, page_size=8
    )
    assert engine.stats().prefix_cache_hits >= 40 // 8 * 8
    engine.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_several_tokens_a_step_at_tp2(model_dir: Callable[[str], Path], async_scheduling: bool) -> None:
    """Rank 0 samples and gets the scripted tokens; the other rank computes them from the plans it is sent."""
    setup = dict(max_batch_tokens=32, page_size=4, num_pages=None, cpu_kv_cache_gib=48 * 1024 / 2**30)
    engine, _ = _scripted_run(
        model_dir("llama"), "llama", 16, tensor_parallel_size=2, async_scheduling=async_scheduling, **setup
    )
    assert engine.scheduler.num_preemptions > 0
    engine.close()
