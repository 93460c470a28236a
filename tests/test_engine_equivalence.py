"""The oracle: greedy output of every request in a packed, chunked, preempted, prefix-shared batch equals that
prompt run alone through the model's own `generate` (float32, CPU), and so do the logprobs of the chosen tokens
(which catch what greedy tokens alone miss: a bias that shifts every score a little)."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from engine import EngineConfig, EngineCore, SamplingParams, generate_batch
from engine.core.kv_cache import sliding_pool_pages
from engine.core.observer import StepRecord

ARCHS = [
    "llama",
    "qwen3",
    "mistral",
    "qwen2",
    "qwen2_hybrid",
    "gpt2",
    "gpt_neox",
    "demo",
    "gemma2",
    "gemma3_text",
    "bloom",
    "falcon",
    "falcon_gqa",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "phi3",
    "starcoder2",
    "cohere",
    "granite",
    "stablelm",
    "gpt_oss",  # attention sinks beside alternating sliding windows; biased experts (native)
    "deepseek_v2",  # latent attention (absorbed, over a latent cache); group-limited softmax routing, shared experts
    "deepseek_v3",  # the same with a LoRA'd query, YaRN, sigmoid routing with a correction bias
    "glm4_moe_lite",  # V3's layers, a sparse layer before a dense one
    "mamba",  # state-space layers only: a recurrent state per request in slots, the pages count tokens only
    "falcon_mamba",  # Mamba with weightless RMSNorms on the time step, B and C
    "mamba2",  # the chunked (SSD) scan, grouped B and C, a gated norm
    "jamba",  # Mamba layers with inner norms and experts beside attention without rotary positions
    "bamba",  # Mamba2 layers beside attention with half its head dimensions rotary
    "granitemoehybrid",  # Mamba2 layers beside rotary attention, shared MLP plus experts, multipliers
]
LOGPROB_TOLERANCE = 1e-4
DEMO_MODEL = Path(__file__).resolve().parents[1] / "server" / "default_model"


def _model_path(model_dir: Callable[[str], Path], arch: str) -> Path:
    """`demo` is the embedded model `ferry serve` runs by default; the rest are built by the factory."""
    return DEMO_MODEL if arch == "demo" else model_dir(arch)


def _prompts(vocab: int, shared_prefix: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(1234)
    prefix = [rng.randrange(10, vocab) for _ in range(shared_prefix)]
    lengths = [3, 9, 17, 24, 31, 40, 47, 52, 60, 66, 12, 5]
    prompts = [prefix + [rng.randrange(10, vocab) for _ in range(n)] for n in lengths]
    max_new = [7, 12, 20, 5, 16, 9, 24, 11, 6, 14, 18, 30]
    return prompts, max_new


_reference_cache: dict[tuple[str, int], tuple[list[list[int]], list[list[float]]]] = {}


def generate_alone(
    hf: PreTrainedModel, prompts: list[list[int]], max_new: list[int]
) -> tuple[list[list[int]], list[list[float]]]:
    """Each prompt alone through the model's own `generate`, greedy: its tokens and their logprobs."""
    tokens, logprobs = [], []
    for prompt, n in zip(prompts, max_new, strict=True):
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            min_new_tokens=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        generated = out.sequences[0, len(prompt) :]
        steps = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)  # [n, vocab], the raw logits'
        tokens.append(generated.tolist())
        logprobs.append(steps.gather(1, generated[:, None]).squeeze(1).tolist())
    return tokens, logprobs


def _reference(
    model_path: Path, arch: str, shared_prefix: int
) -> tuple[list[list[int]], list[int], list[list[int]], list[list[float]]]:
    """Prompts, their token budgets, and each prompt's greedy tokens and their logprobs from `generate` alone."""
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    prompts, max_new = _prompts(hf.config.vocab_size, shared_prefix)
    key = (arch, shared_prefix)
    if key not in _reference_cache:
        _reference_cache[key] = generate_alone(hf, prompts, max_new)
    return prompts, max_new, *_reference_cache[key]


CONFIGS: dict[str, dict] = {
    "mixed": dict(max_batch_tokens=96, page_size=16),
    "chunked": dict(max_batch_tokens=16, page_size=16),
    "preempt": dict(max_batch_tokens=256, page_size=4, num_pages=24),
    "page1": dict(max_batch_tokens=128, page_size=1),
    "page16": dict(max_batch_tokens=512, page_size=16),
    # flash-attn's paged kernels need pages of 256: the torch backend must agree at that size too.
    "page256": dict(max_batch_tokens=96, page_size=256, num_pages=32),
}


class _QueryLens:
    """Keeps each step's tokens per sequence."""

    def __init__(self, into: list[list[int]]) -> None:
        self.into = into

    def on_step(self, record: StepRecord) -> None:
        if record.plan.request_ids:
            self.into.append(list(record.plan.num_new_tokens))


def _run(
    model_path: Path, prompts, max_new, **overrides
) -> tuple[EngineCore, list[list[int]], list[list[float]], list[list[int]]]:
    # A few hundred pages: a 1 GiB default cache would make every debug invariant check scan ~10^5 pages.
    config = EngineConfig.of(model=str(model_path), debug_checks=True, **{"num_pages": 512, **overrides})
    query_lens: list[list[int]] = []
    engine = EngineCore(config, observers=[_QueryLens(query_lens)])
    params = [SamplingParams(max_new_tokens=n, logprobs=True) for n in max_new]
    results = generate_batch(prompts, params=params, engine=engine)
    outputs = [results[f"req_{i}"].generated_ids for i in range(len(prompts))]
    logprobs = [[t.logprob for t in results[f"req_{i}"].logprobs] for i in range(len(prompts))]
    return engine, outputs, logprobs, query_lens


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("setup", list(CONFIGS))
def test_greedy_equals_generate(model_dir: Callable[[str], Path], arch: str, setup: str) -> None:
    path = _model_path(model_dir, arch)
    prompts, max_new, expected, expected_logprobs = _reference(path, arch, 0)
    config = CONFIGS[setup]
    if (arch, setup) == ("demo", "preempt"):
        # The demo model ends these prompts early enough that 24 pages never run out: fewer make it preempt.
        config = {**config, "num_pages": 20}
    engine, outputs, logprobs, query_lens = _run(path, prompts, max_new, **config)
    for i, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        assert got == want, f"{arch}/{setup}: request {i} (prompt {len(prompts[i])} tokens) diverged"
        worst = max(abs(a - b) for a, b in zip(logprobs[i], expected_logprobs[i], strict=True))
        assert worst <= LOGPROB_TOLERANCE, f"{arch}/{setup}: request {i}: a chosen token's logprob is {worst:.2e} off"
    assert engine.is_idle_and_clean()
    engine.kv_cache.check_invariants()
    if setup == "mixed":
        assert any(1 in lens and max(lens) > 1 for lens in query_lens), "no step mixed prefill and decode"
    if setup == "chunked":
        longest = max(len(p) for p in prompts)
        assert longest > CONFIGS[setup]["max_batch_tokens"]
        assert all(sum(lens) <= CONFIGS[setup]["max_batch_tokens"] for lens in query_lens)
    if setup == "preempt":
        assert engine.scheduler.num_preemptions > 0


# Compiled graphs see neither pages nor packing (attention is one opaque op in them): the compiled oracle runs the
# native models over the setups whose steps differ in shape (mixed prefill and decode, one-token steps, chunks).
COMPILED_CASES = [
    ("llama", "mixed", False),
    ("llama", "chunked", False),
    ("llama", "preempt", True),  # steps run on the runner's thread, the warm-up ran on this one
    ("qwen3", "mixed", False),  # q/k norms
    ("qwen2_hybrid", "preempt", False),  # QKV bias; two sliding windows, so two graphs of each size
    ("demo", "mixed", False),
    ("qwen3_moe", "chunked", False),  # the experts' C++ op opaque in the graph; a dense and a sparse layer
    ("gpt_oss", "mixed", False),  # sinks, alternating windows, grouped_mm experts with biases
    ("deepseek_v3", "chunked", False),  # latent attention: one wide KV head through the op
]


@pytest.mark.parametrize("level", ["piecewise", "full"])
@pytest.mark.parametrize(("arch", "setup", "async_scheduling"), COMPILED_CASES)
def test_compiled_greedy_equals_generate(
    model_dir: Callable[[str], Path], arch: str, setup: str, async_scheduling: bool, level: str, compiling: None
) -> None:
    """The compiled paths against `generate`; and no step after the start-up's warm-up compiles anything."""
    from torch._dynamo.utils import counters

    path = _model_path(model_dir, arch)
    prompts, max_new, expected, expected_logprobs = _reference(path, arch, 0)
    before = counters["stats"]["unique_graphs"]
    config = EngineConfig.of(
        model=str(path),
        debug_checks=True,
        compile=level,
        async_scheduling=async_scheduling,
        **{"num_pages": 512, **CONFIGS[setup]},
    )
    engine = EngineCore(config)
    warmed_up = counters["stats"]["unique_graphs"]
    # A one-token graph and a dynamic one, and the dynamic one again on the prefill threads where a step can take
    # them (a graph is compiled for a thread count): of the whole decoder, or of a layer per sliding window.
    # Threads that follow the load get graphs for each count they may take (every core, or one fewer).
    cores = len(os.sched_getaffinity(0))
    decode_counts = {cores, max(1, cores - 1)}
    per_kind = 2 * len(decode_counts)
    # Piecewise: a graph per kind of layer (its sliding window; an MLP or a mixture of experts).
    layers = engine.runner.model.model.layers
    kinds = len({(layer.self_attn.sliding_window, type(layer.mlp)) for layer in layers})
    graphs = per_kind if level == "full" else per_kind * kinds
    assert warmed_up - before == graphs
    params = [SamplingParams(max_new_tokens=n, logprobs=True) for n in max_new]
    free = engine.runner.step_threads.free if engine.runner.step_threads is not None else None
    # Once on each count (pinned, as the load would pick it): none compiles a graph.
    for count in sorted(decode_counts) if free is not None else [None]:
        if free is not None:
            free.pinned = count
        results = generate_batch(prompts, params=params, engine=engine)
        assert counters["stats"]["unique_graphs"] == warmed_up, f"a step recompiled after the warm-up ({count})"
        for i, want in enumerate(expected):
            got = results[f"req_{i}"]
            assert got.generated_ids == want, f"{arch}/{setup}/{level}: request {i} diverged"
            worst = max(abs(t.logprob - w) for t, w in zip(got.logprobs, expected_logprobs[i], strict=True))
            assert worst <= LOGPROB_TOLERANCE, f"{arch}/{setup}/{level}: request {i}: a logprob is {worst:.2e} off"
    assert engine.is_idle_and_clean()
    if setup == "preempt":
        assert engine.scheduler.num_preemptions > 0
    engine.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2_hybrid", "gpt2", "gemma2"])
@pytest.mark.parametrize("setup", ["mixed", "chunked", "preempt", "page1"])
def test_async_scheduling_greedy_equals_generate(model_dir: Callable[[str], Path], arch: str, setup: str) -> None:
    """Planning each step while the one before it runs changes nothing in the output: the same tokens and
    logprobs as each prompt alone, with placeholders filled by the runner, under chunking and preemption."""
    path = _model_path(model_dir, arch)
    prompts, max_new, expected, expected_logprobs = _reference(path, arch, 0)
    engine, outputs, logprobs, _ = _run(path, prompts, max_new, async_scheduling=True, **CONFIGS[setup])
    for i, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        assert got == want, f"{arch}/{setup} async: request {i} differs"
        worst = max(abs(a - b) for a, b in zip(logprobs[i], expected_logprobs[i], strict=True))
        assert worst <= LOGPROB_TOLERANCE, f"{arch}/{setup} async: request {i}: a logprob is {worst:.2e} off"
    assert engine.is_idle_and_clean()
    if setup == "preempt":
        assert engine.scheduler.num_preemptions > 0
    engine.close()


PREFIX_ARCHS = ["llama", "qwen3", "mistral", "qwen2_hybrid", "gpt2", "gemma2", "bloom", "mixtral", "qwen3_moe"]


@pytest.mark.parametrize("arch", [*PREFIX_ARCHS, "gpt_oss", "deepseek_v3"])
def test_prefix_sharing_greedy(model_dir: Callable[[str], Path], arch: str) -> None:
    path = model_dir(arch)
    prompts, max_new, expected, _ = _reference(path, arch, shared_prefix=40)
    # Small budget: the first prompt's pages are cached before later prompts are admitted.
    engine, outputs, _, _ = _run(path, prompts, max_new, max_batch_tokens=64, page_size=8)
    assert outputs == expected
    stats = engine.stats()
    assert stats.prefix_cache_hits >= 40 // 8 * 8
    assert stats.prefix_cache_queries >= stats.prefix_cache_hits
    assert engine.is_idle_and_clean()


def test_sliding_window_releases_pages(model_dir: Callable[[str], Path]) -> None:
    path = model_dir("mistral")  # sliding_window 24 in the fixture
    prompt = list(range(10, 90))
    engine = EngineCore(EngineConfig.of(model=str(path), page_size=4, num_pages=64, debug_checks=True))
    engine.add_request("a", prompt, SamplingParams(max_new_tokens=4))
    engine.step()
    (table,) = engine.kv_cache.page_tables("a")
    assert -1 in table, "pages far outside the window should have been released"
    live = [p for p in table if p >= 0]
    assert len(live) * 4 <= 24 + 2 * 4
    while engine.has_unfinished():
        engine.step()
    assert engine.is_idle_and_clean()


def test_hybrid_model_sliding_layers_release_pages(model_dir: Callable[[str], Path]) -> None:
    """Full-attention layers keep every page; the sliding layers' own pool lets old pages go and is sized to
    the windows of all running sequences, so the memory budget goes to the full layers."""
    path = model_dir("qwen2_hybrid")  # layer 0 full attention, layer 1 sliding window 20
    config = EngineConfig.of(model=str(path), page_size=4, max_num_seqs=8, max_batch_tokens=128, debug_checks=True)
    engine = EngineCore(config)
    primary, sliding = engine.kv_cache.pools
    assert [layout.window for layout in engine.kv_cache.layouts] == [None, 20]
    assert sliding.num_pages == sliding_pool_pages(20, 4, max_num_seqs=8, max_batch_tokens=128) < primary.num_pages
    # Each layer's cache: its pool's pages and the scratch page padded decode rows use
    # (engine/execution/cuda_graphs.py).
    assert [cache[0].shape[0] for cache in engine.runner.kv_caches] == [primary.num_pages + 1, sliding.num_pages + 1]
    engine.add_request("a", list(range(10, 90)), SamplingParams(max_new_tokens=4))
    engine.step()
    full_table, window_table = engine.kv_cache.page_tables("a")
    assert -1 not in full_table
    assert window_table.count(-1) == (80 - 20) // 4
    assert len([p for p in window_table if p >= 0]) * 4 <= 20 + 2 * 4
    while engine.has_unfinished():
        engine.step()
    assert engine.is_idle_and_clean()


@pytest.mark.parametrize("setup", ["mixed", "chunked", "preempt"])
def test_prompt_logprobs_equal_the_models_own(model_dir: Callable[[str], Path], setup: str) -> None:
    """Every prompt token's logprob given the tokens before it (and the top alternatives), as the model computes
    them in one forward pass, under chunked prefill and recompute after preemption, next to requests that share a
    cached prefix."""
    path = model_dir("llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts, max_new = _prompts(hf.config.vocab_size, shared_prefix=16)
    config = EngineConfig.of(model=str(path), debug_checks=True, **{"num_pages": 512, **CONFIGS[setup]})
    engine = EngineCore(config)
    scored = [i % 2 == 0 for i in range(len(prompts))]
    params = [
        SamplingParams(max_new_tokens=n, prompt_logprobs=3 if s else None) for n, s in zip(max_new, scored, strict=True)
    ]
    results = generate_batch(prompts, params=params, engine=engine)
    for i, prompt in enumerate(prompts):
        got = results[f"req_{i}"].prompt_logprobs
        if not scored[i]:
            assert got is None
            continue
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
        assert got is not None and [e.token_id for e in got] == prompt[1:]
        chosen = torch.tensor([e.logprob for e in got])
        torch.testing.assert_close(
            chosen, want.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1), atol=1e-4, rtol=0
        )
        top = want.topk(3, dim=-1)
        assert [[t for t, _ in e.top] for e in got] == top.indices.tolist()
    assert engine.is_idle_and_clean()
    if setup == "preempt":
        assert engine.scheduler.num_preemptions > 0
