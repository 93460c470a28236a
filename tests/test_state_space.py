"""State-space models and hybrids (Mamba, Mamba2, Jamba, Granite 4): served exactly or refused by name.

The oracle over mixed batches, chunked prefill, preemption and page sizes runs in tests/test_engine_equivalence.py
(these families are in its ARCHS); the scan maths against a per-position reference in tests/test_ssm.py. Here:
async scheduling (a step planned while the one before it runs), prompts sharing a prefix (computed, never a state
reused), prompt logprobs, admission bounded by the state slots, bfloat16 on the CPU kernels, and the refusals.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine import EngineConfig, EngineCore, SamplingParams, generate_batch
from engine.config import EngineStartupError
from engine.core.observer import StepRecord
from engine.core.state_slots import StateSlots
from engine.models.loader import load_model
from engine.models.support import UnsupportedModelError
from tests.server_harness import engine_idle, running_server, wait_until
from tests.test_engine_equivalence import CONFIGS, LOGPROB_TOLERANCE, _prompts, _reference, _run

FAMILIES = ["mamba", "falcon_mamba", "mamba2", "jamba", "bamba", "granitemoehybrid"]


def _assert_exact(outputs: list, logprobs: list, expected: list, expected_logprobs: list, case: str) -> None:
    for i, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        assert got == want, f"{case}: request {i} diverged"
        worst = max(abs(a - b) for a, b in zip(logprobs[i], expected_logprobs[i], strict=True))
        assert worst <= LOGPROB_TOLERANCE, f"{case}: request {i}: a chosen token's logprob is {worst:.2e} off"


@pytest.mark.parametrize("arch", ["mamba2", "jamba"])
@pytest.mark.parametrize("setup", ["mixed", "preempt"])
def test_async_scheduling_keeps_each_state_in_order(model_dir: Callable[[str], Path], arch: str, setup: str) -> None:
    """A step planned while the one before it runs (its decodes' tokens placeholders): each slot's state still
    advances one step at a time, and a preempted request recomputes its state from its first token."""
    path = model_dir(arch)
    prompts, max_new, expected, expected_logprobs = _reference(path, arch, 0)
    engine, outputs, logprobs, _ = _run(path, prompts, max_new, async_scheduling=True, **CONFIGS[setup])
    _assert_exact(outputs, logprobs, expected, expected_logprobs, f"{arch}/{setup} async")
    assert engine.is_idle_and_clean()
    if setup == "preempt":
        assert engine.scheduler.num_preemptions > 0
    engine.close()


@pytest.mark.parametrize("arch", FAMILIES)
def test_prompts_sharing_a_prefix_are_each_computed_whole(
    model_dir: Callable[[str], Path], arch: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Prefix caching is off for these models, and start-up says so: a cached page holds K and V, not the state at
    its end, so a shared prefix is recomputed rather than a wrong state reused."""
    path = model_dir(arch)
    prompts, max_new, expected, expected_logprobs = _reference(path, arch, shared_prefix=40)
    with caplog.at_level(logging.INFO, logger="engine.core.engine_core"):
        engine, outputs, logprobs, _ = _run(path, prompts, max_new, max_batch_tokens=64, page_size=8)
    _assert_exact(outputs, logprobs, expected, expected_logprobs, f"{arch} shared prefix")
    assert engine.stats().prefix_cache_hits == 0
    assert f"prefix caching is off for {AutoConfig.from_pretrained(path).model_type}" in caplog.text
    engine.close()


@pytest.mark.parametrize("arch", ["mamba2", "granitemoehybrid"])
def test_prompt_logprobs_equal_the_models_own_across_chunks(model_dir: Callable[[str], Path], arch: str) -> None:
    """Every prompt token's logprob as the model's own forward pass gives it, the prompt computed in chunks of 16
    (the state carried from chunk to chunk)."""
    path = model_dir(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts, _ = _prompts(hf.config.vocab_size)
    engine = EngineCore(EngineConfig.of(model=str(path), num_pages=512, debug_checks=True, **CONFIGS["chunked"]))
    params = SamplingParams(max_new_tokens=1, prompt_logprobs=0)
    results = generate_batch(prompts, params=params, engine=engine)
    for i, prompt in enumerate(prompts):
        scored = results[f"req_{i}"].prompt_logprobs
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
        assert scored is not None and [entry.token_id for entry in scored] == prompt[1:]
        got = torch.tensor([entry.logprob for entry in scored])
        expected = want.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
        assert torch.allclose(got, expected, atol=LOGPROB_TOLERANCE), f"{arch}: prompt {i}"
    engine.close()


class _Running:
    def __init__(self) -> None:
        self.most = 0

    def on_step(self, record: StepRecord) -> None:
        self.most = max(self.most, len(record.plan.request_ids))


class _Drafts:
    def __init__(self) -> None:
        self.planned = 0

    def on_step(self, record: StepRecord) -> None:
        self.planned += sum(len(drafts) for drafts in record.plan.draft_token_ids)


def test_a_prediction_is_not_drafted_from(model_dir: Callable[[str], Path]) -> None:
    """Predicted Outputs on a recurrent model: no draft is planned (a rejected one would have advanced the state),
    and the output is exactly what it is without the prediction."""
    path = model_dir("mamba2")
    prompts, max_new, expected, _ = _reference(path, "mamba2", 0)
    drafts = _Drafts()
    engine = EngineCore(EngineConfig.of(model=str(path), num_pages=512), observers=[drafts])
    for i, (prompt, n) in enumerate(zip(prompts[:4], max_new, strict=False)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=n), prediction=tuple(expected[i]))
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id] += output.new_token_ids
    assert [outputs[f"r{i}"] for i in range(4)] == expected[:4]
    assert drafts.planned == 0
    engine.close()


def test_admission_counts_the_state_slots(model_dir: Callable[[str], Path]) -> None:
    """A memory budget holding three sequences' states: never more than three run at once, whatever
    --max-num-seqs allows, and every request is still served exactly."""
    path = model_dir("mamba")
    probe = EngineCore(EngineConfig.of(model=str(path), num_pages=512))
    per_sequence = sum(conv[0].nbytes + scan[0].nbytes for conv, scan in probe.runner.kv_caches)
    probe.close()
    prompts, max_new, expected, expected_logprobs = _reference(path, "mamba", 0)
    running = _Running()
    config = EngineConfig.of(model=str(path), cpu_kv_cache_gib=3.5 * per_sequence / 2**30, debug_checks=True)
    engine = EngineCore(config, observers=[running])
    assert engine.kv_cache.states is not None and engine.kv_cache.states.num_slots == 3
    params = [SamplingParams(max_new_tokens=n, logprobs=True) for n in max_new]
    results = generate_batch(prompts, params=params, engine=engine)
    outputs = [results[f"req_{i}"].generated_ids for i in range(len(prompts))]
    logprobs = [[t.logprob for t in results[f"req_{i}"].logprobs] for i in range(len(prompts))]
    _assert_exact(outputs, logprobs, expected, expected_logprobs, "three slots")
    assert running.most == 3
    assert engine.is_idle_and_clean()
    assert engine.stats().kv_cache_usage == 0.0
    engine.close()


def test_a_model_without_attention_reports_its_state_slots_as_cache_usage(model_dir: Callable[[str], Path]) -> None:
    """Mamba's pages hold no bytes: the cache usage the metrics report is its slots in use (two of four)."""
    engine = EngineCore(EngineConfig.of(model=str(model_dir("mamba")), num_pages=64, max_num_seqs=4))
    for i in range(2):
        engine.add_request(f"r{i}", [11, 40, 7, 99], SamplingParams(max_new_tokens=4))
    engine.step()
    assert engine.stats().kv_cache_usage == pytest.approx(0.5)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().kv_cache_usage == 0.0
    engine.close()


def test_a_budget_below_one_state_is_refused_by_name(model_dir: Callable[[str], Path]) -> None:
    with pytest.raises(EngineStartupError, match=r"one sequence's recurrent state takes .* --cpu-kv-cache-gib"):
        EngineCore(EngineConfig.of(model=str(model_dir("mamba2")), cpu_kv_cache_gib=1e-9))


@pytest.mark.parametrize("arch", ["mamba2", "jamba"])
def test_bfloat16_serves_every_request_in_full(model_dir: Callable[[str], Path], arch: str) -> None:
    """bfloat16 weights on the CPU kernels' linears, the scans in float32: tokens are not compared with float32's
    (roundings differ), only that each request completes."""
    engine = EngineCore(EngineConfig.of(model=str(model_dir(arch)), dtype="bfloat16", num_pages=64))
    prompts = [[11, 40, 7, 99], list(range(20, 90))]
    results = generate_batch(prompts, params=[SamplingParams(max_new_tokens=8, ignore_eos=True)] * 2, engine=engine)
    assert [len(results[f"req_{i}"].generated_ids) for i in range(2)] == [8, 8]
    assert engine.runner.kv_caches[0][1].dtype == torch.float32  # the scan state keeps float32
    engine.close()


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (dict(compile="full"), "--compile full"),
        (dict(enable_lora=True), "--enable-lora"),
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "--speculative-config"),
    ],
)
def test_options_the_state_does_not_run_with_are_refused_by_name(
    model_dir: Callable[[str], Path], options: dict, named: str
) -> None:
    with pytest.raises(EngineStartupError, match=f"model_type 'mamba2' has recurrent .*{named}"):
        load_model(EngineConfig.of(model=str(model_dir("mamba2")), num_pages=16, **options))


def test_the_transformers_adapter_is_refused_for_state_models(model_dir: Callable[[str], Path]) -> None:
    with pytest.raises(UnsupportedModelError, match="recurrent layers on the transformers adapter"):
        load_model(EngineConfig.of(model=str(model_dir("jamba")), num_pages=16, model_impl="transformers"))


@pytest.mark.parametrize(
    "model_type", ["falcon_h1", "nemotron_h", "zamba2", "qwen3_next", "qwen3_5_text", "kimi_linear"]
)
def test_recurrent_families_without_native_modules_are_refused_before_any_weight(
    tmp_path: Path, model_type: str
) -> None:
    AutoConfig.for_model(model_type).save_pretrained(tmp_path)  # a config alone: nothing else is read
    with pytest.raises(UnsupportedModelError) as info:
        load_model(EngineConfig.of(model=str(tmp_path), num_pages=16))
    assert info.value.model_type == model_type
    assert info.value.feature.startswith("recurrent layers (state-space, linear-attention or RNN)")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 7)), max_size=60), st.integers(1, 5))
def test_slots_are_never_shared_nor_lost(ops: list[tuple[bool, int]], num_slots: int) -> None:
    slots = StateSlots(num_slots)
    held: dict[str, int] = {}
    for take, request in ops:
        rid = f"r{request}"
        if take:
            slot = slots.take(rid)
            if rid in held:
                assert slot == held[rid]
            elif len(held) == num_slots:
                assert slot is None
            else:
                assert slot is not None and slot not in held.values()
                held[rid] = slot
        else:
            slots.free(rid)
            held.pop(rid, None)
        slots.check_invariants()
        assert slots.num_free == num_slots - len(held)


def test_served_over_http_with_requests_waiting_for_a_slot(model_dir: Callable[[str], Path]) -> None:
    """`ferry serve` on a hybrid, four concurrent streamed completions through the official client with two state
    slots: each text is the model's own greedy continuation (transformers' `generate`, decoded), and the engine ends
    idle."""
    path = model_dir("jamba")
    prompts, max_new, expected, _ = _reference(path, "jamba", 0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    chosen = [0, 3, 5, 9]

    async def complete(client: openai.AsyncOpenAI, i: int) -> str:
        stream = await client.completions.create(
            model=path.name, prompt=prompts[i], max_tokens=max_new[i], temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def run(base_url: str) -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused")
        return await asyncio.gather(*(complete(client, i) for i in chosen))

    with running_server(path, "--max-num-seqs", "2") as base_url:
        texts = asyncio.run(run(base_url))
        with httpx.Client(base_url=base_url) as http:
            wait_until(lambda: engine_idle(http))
    assert texts == [tokenizer.decode(expected[i], skip_special_tokens=True) for i in chosen]
