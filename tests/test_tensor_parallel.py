"""Tensor parallelism on CPU (gloo): the oracle at TP=2, through the engine and through `ferry serve` (one node and
two), the refusals, and what happens when a rank dies or hangs.

Starting ranks is the slow part (a worker imports torch and transformers: several seconds on a busy machine), so
each engine here runs one config that chunks prefills, preempts and shares a prefix all at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from engine import (
    ContinuousBatchingManager,
    EngineConfig,
    EngineCore,
    FinishReason,
    SamplingParams,
    StructuredOutput,
    generate_batch,
)
from engine.core.step import SchedulerOutput
from engine.distributed.parallel import COLLECTIVES
from server.tokens import Tokenizer
from tests.model_factory import build_model_dir
from tests.server_harness import REPO_ROOT, free_port, metric, metric_samples, node_process, server_process
from tests.test_engine_equivalence import LOGPROB_TOLERANCE, _QueryLens, _reference, _run
from tests.test_server_faults import process_gone, read_events, read_rest

pytestmark = pytest.mark.timeout(300)

SHARED_PREFIX = 16
# Prefills in chunks of 32 tokens, pages of 4, and a cache too small for the batch (preemption), sized in bytes:
# 48 pages at TP=2, where each rank's cache holds one of the two KV heads.
SETUP = dict(max_batch_tokens=32, page_size=4, num_pages=None, cpu_kv_cache_gib=48 * 1024 / 2**30)


@pytest.mark.parametrize(
    "arch", ["llama", "qwen3", "mistral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3"]
)
def test_tp2_greedy_equals_tp1_and_generate(model_dir: Callable[[str], Path], arch: str) -> None:
    path = model_dir(arch)
    prompts, max_new, expected, expected_logprobs = _reference(path, arch, SHARED_PREFIX)
    tp2_steps: list[list[int]] = []
    config = EngineConfig.of(model=str(path), debug_checks=True, tensor_parallel_size=2, **SETUP)
    with EngineCore(config, observers=[_QueryLens(tp2_steps)]) as tp2:
        workers = tp2.worker_pids
        params = [SamplingParams(max_new_tokens=n, logprobs=True) for n in max_new]
        results = generate_batch(prompts, params=params, engine=tp2)
        tp2_outputs = [results[f"req_{i}"].generated_ids for i in range(len(prompts))]
        for i, (got, want) in enumerate(zip(tp2_outputs, expected, strict=True)):
            assert got == want, f"{arch}: request {i} (prompt {len(prompts[i])} tokens) diverged at TP=2"
            logprobs = [t.logprob for t in results[f"req_{i}"].logprobs]
            worst = max(abs(a - b) for a, b in zip(logprobs, expected_logprobs[i], strict=True))
            assert worst <= LOGPROB_TOLERANCE, f"{arch}: request {i}: a chosen token's logprob is {worst:.2e} off"
        assert max(len(p) for p in prompts) > SETUP["max_batch_tokens"] >= max(sum(lens) for lens in tp2_steps)
        assert tp2.scheduler.num_preemptions > 0
        assert tp2.stats().prefix_cache_hits >= SHARED_PREFIX
        assert tp2.is_idle_and_clean()
        assert tp2.tensor_parallel is not None and all(tp2.tensor_parallel.seconds[k] > 0 for k in COLLECTIVES)
        # A rank's cache holds half the KV heads, so the same bytes hold twice the pages one device's would; a
        # latent (MLA) is not split by heads: each rank holds all of it, the same pages as one device.
        assert tp2.runner.kv_caches[0][0].shape[2] == 1
        one_device = EngineCore(EngineConfig.of(model=str(path), **SETUP)).kv_cache.num_pages
        assert tp2.kv_cache.num_pages == (one_device if arch.startswith("deepseek") else 2 * one_device)
        pages = tp2.kv_cache.num_pages
        planned = list(tp2_steps)
        # A plan bigger than the broadcast buffer (64 KiB) travels in two broadcasts; the worker stays in step.
        tp2.tensor_parallel.broadcast_plan(SchedulerOutput(finished_ids=tuple(f"gone-{i}" for i in range(20_000))))
        again = generate_batch(prompts[:2], params=[SamplingParams(max_new_tokens=n) for n in max_new[:2]], engine=tp2)
        assert [again[f"req_{i}"].generated_ids for i in range(2)] == expected[:2]
    assert len(workers) == 1
    assert all(process_gone(pid) for pid in workers), "close() leaves no worker behind"
    # TP=1 with as many pages plans the very same steps, and computes the same tokens.
    _, tp1_outputs, _, tp1_steps = _run(path, prompts, max_new, **{**SETUP, "num_pages": pages})
    assert tp1_steps == planned and tp1_outputs == tp2_outputs


def test_tp2_with_async_scheduling_equals_generate(model_dir: Callable[[str], Path]) -> None:
    """Planned one step ahead, a decode's token is known only to rank 0 when the plan is made: the worker gets
    it filled in, under chunking, preemption and prefix sharing."""
    path = model_dir("llama")
    prompts, max_new, expected, _ = _reference(path, "llama", SHARED_PREFIX)
    config = EngineConfig.of(model=str(path), debug_checks=True, tensor_parallel_size=2, async_scheduling=True, **SETUP)
    with EngineCore(config) as tp2:
        params = [SamplingParams(max_new_tokens=n) for n in max_new]
        results = generate_batch(prompts, params=params, engine=tp2)
        assert [results[f"req_{i}"].generated_ids for i in range(len(prompts))] == expected
        assert tp2.scheduler.num_preemptions > 0
        assert tp2.is_idle_and_clean()


def test_fewer_kv_heads_than_ranks_tied_padded_vocab_and_biases(tmp_path: Path) -> None:
    """One KV head, replicated on both ranks; a vocabulary that does not split evenly (the last rank's part is
    padded); the LM head tied to the embedding; biases on the row-parallel o and down projections. Through the
    background manager, which closes (stops the ranks of) the engine it built."""
    path = build_model_dir(
        tmp_path / "llama-1kv",
        "llama",
        num_key_value_heads=1,
        vocab_size=387,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
    )
    prompts, max_new, expected, _ = _reference(path, "llama-1kv", 0)
    with ContinuousBatchingManager(EngineConfig.of(model=str(path), tensor_parallel_size=2, num_pages=256)) as manager:
        ids = [manager.add_request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, max_new, strict=True)]
        results = [manager.get_result(rid, timeout=120) for rid in ids]
        assert manager.engine.runner.kv_caches[0][0].shape[2] == 1
        workers = manager.engine.worker_pids
    assert [r.generated_ids for r in results] == expected
    assert len(workers) == 1 and all(process_gone(pid) for pid in workers)


def test_constrained_sampled_and_scored_requests_at_tp2_equal_tp1(model_dir: Callable[[str], Path]) -> None:
    """Grammars live where sampling happens, on the driver: a JSON-schema and a seeded regex request, a seeded
    sampled one and one scoring its prompt generate at TP=2 what they do at TP=1."""
    path = model_dir("llama")
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "maximum": 120}},
        "required": ["name", "age"],
    }
    prompts = [[1, *range(40, 40 + n)] for n in (5, 23, 37, 30)]
    params = [
        SamplingParams(max_new_tokens=120, structured_output=StructuredOutput("json_schema", json.dumps(schema))),
        SamplingParams(
            max_new_tokens=30,
            structured_output=StructuredOutput("regex", "[a-z]{2,5}-[0-9]{3}"),
            temperature=1.0,
            seed=3,
        ),
        SamplingParams(max_new_tokens=30, temperature=0.8, top_p=0.9, seed=5),
        SamplingParams(max_new_tokens=8, prompt_logprobs=2),
    ]

    def run(**overrides) -> dict:
        with EngineCore(EngineConfig.of(model=str(path), num_pages=128, **overrides)) as engine:
            results = generate_batch(prompts, params=params, engine=engine)
            assert engine.is_idle_and_clean()
            return results

    tp1, tp2 = run(), run(tensor_parallel_size=2)
    assert [r.generated_ids for r in tp2.values()] == [r.generated_ids for r in tp1.values()]
    assert tp2["req_0"].finish_reason is FinishReason.STOP and json.loads(
        Tokenizer.load(path).decode(tp2["req_0"].generated_ids[:-1])
    )
    scored1, scored2 = tp1["req_3"].prompt_logprobs, tp2["req_3"].prompt_logprobs
    assert scored1 is not None and scored2 is not None
    assert [e.token_id for e in scored2] == [e.token_id for e in scored1] == prompts[3][1:]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(scored1, scored2, strict=True)) <= LOGPROB_TOLERANCE


@pytest.mark.parametrize(
    ("arch", "overrides", "message"),
    [
        ("llama", dict(tensor_parallel_size=3), "4 attention heads do not divide by 3"),
        ("gpt2", dict(tensor_parallel_size=2), "transformers adapter, which Ferry cannot shard"),
        ("llama", dict(tensor_parallel_size=2, model_impl="transformers"), "transformers adapter"),
    ],
    ids=["heads-do-not-divide", "breadth-path", "forced-adapter"],
)
def test_what_cannot_be_sharded_exactly_is_refused(
    model_dir: Callable[[str], Path], arch: str, overrides: dict, message: str
) -> None:
    config = EngineConfig.of(model=str(model_dir(arch)), **overrides)
    with pytest.raises(ValueError, match=message):
        EngineCore(config)


def test_the_layout_is_checked_before_any_rank_starts(model_dir: Callable[[str], Path]) -> None:
    path = str(model_dir("llama"))
    with pytest.raises(ValueError, match=r"nnodes \(2\) must divide tensor_parallel_size \(3\)"):
        EngineCore(EngineConfig.of(model=path, tensor_parallel_size=3, nnodes=2))
    with pytest.raises(ValueError, match=r"node_rank must be in \[0, nnodes=2\), got 2"):
        EngineConfig.of(model=path, tensor_parallel_size=2, nnodes=2, node_rank=2).parallel.check_layout()
    assert EngineConfig.of(model=path, tensor_parallel_size=4, nnodes=2).parallel.ranks_per_node == 2
    result = subprocess.run(
        [sys.executable, "-m", "ferry", "serve", "--model", path, "--tensor-parallel-size", "4", "--nnodes", "3"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "nnodes (3) must divide tensor_parallel_size (4)" in result.stderr


# ------------------------------------------------------------------------------------------- through the server

MODEL = "tiny"
# Prefills in chunks of 16 tokens; 20 pages of 4 tokens, far fewer than the four requests need together
# (preemption, even with Mistral's window letting old pages go); the prompts share their first page.
SERVE_SETUP = ("--served-model-name", MODEL, "--max-batch-tokens", "16", "--page-size", "4", "--num-pages", "20",
               "--log-level", "warning")  # fmt: skip
PROMPTS = [[1, *range(40, 40 + n)] for n in (5, 23, 37, 30)]
MAX_TOKENS = [24, 30, 40, 36]


def _expected_texts(path: Path) -> list[str]:
    """What the server should answer: the TP=1 engine's greedy tokens (the oracle above), detokenized as the
    server does."""
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    results = generate_batch(PROMPTS, EngineConfig.of(model=str(path), num_pages=128, page_size=4), params=params)
    tokenizer = Tokenizer.load(path)
    texts = []
    for i, prompt in enumerate(PROMPTS):
        detokenizer = tokenizer.detokenizer(prompt)
        texts.append(detokenizer.push(results[f"req_{i}"].generated_ids) + detokenizer.flush())
    return texts


async def _complete_all(base_url: str) -> list[str]:
    """The prompts at once, through the OpenAI SDK, greedy."""
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0) as client:
        replies = await asyncio.gather(
            *(
                client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
                )
                for prompt, n in zip(PROMPTS, MAX_TOKENS, strict=True)
            )
        )
    return [reply.choices[0].text for reply in replies]


def _check_served(base_url: str, expected: list[str]) -> None:
    """The prompts answer as expected (chunked, preempted, sharing a prefix), and the server reports TP=2."""
    assert asyncio.run(_complete_all(base_url)) == expected
    with httpx.Client(base_url=base_url, timeout=30) as http:
        card = http.get("/v1/models").json()["data"][0]
        assert card["tensor_parallel_size"] == 2
        samples = metric_samples(http)
        assert metric(samples, "ferry:tensor_parallel_size", model_name=MODEL) == 2
        assert metric(samples, "ferry:num_preemptions_total") > 0
        assert metric(samples, "ferry:prefix_cache_hits_total") > 0
        assert http.get("/metrics.json").json()["tensor_parallel_size"] == 2


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_serve_tp2_answers_as_tp1(model_dir: Callable[[str], Path], arch: str) -> None:
    path = model_dir(arch)
    expected = _expected_texts(path)
    with server_process(path, *SERVE_SETUP, "--tensor-parallel-size", "2") as server:
        assert len(server.worker_pids()) == 1
        _check_served(server.base_url, expected)
        workers = server.worker_pids()
        assert server.stop() == 0
    assert all(process_gone(pid) for pid in workers)


def test_two_nodes_on_localhost_answer_as_one(model_dir: Callable[[str], Path]) -> None:
    """Two `ferry serve` processes with --nnodes 2: node 1 runs rank 1 and no HTTP, node 0 serves; node 1 exits
    (cleanly) when node 0 does."""
    path = model_dir("llama")
    expected = _expected_texts(path)
    layout = ("--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(free_port()))  # fmt: skip
    with node_process(path, *SERVE_SETUP, *layout, "--node-rank", "1") as node1:
        with server_process(path, *SERVE_SETUP, *layout, "--node-rank", "0") as node0:
            assert node0.worker_pids() == [], "node 0 runs rank 0 only: one rank per node"
            _check_served(node0.base_url, expected)
            assert node0.stop() == 0
        assert node1.wait(timeout=30) == 0


# ------------------------------------------------------------------------------------------------------ faults

LONG = {"model": MODEL, "prompt": "Ferry boats", "max_tokens": 480, "ignore_eos": True, "n": 4}


async def _stream_then(server_url: str, act: Callable[[], None]) -> tuple[list[bytes], httpx.Response, float, int]:
    """Stream a long request, `act` three events in, and read until it ends; with the whole of a second request,
    the seconds from `act` to the end of both, and /health's status by then."""
    async with httpx.AsyncClient(base_url=server_url, timeout=60) as client:
        whole = asyncio.create_task(client.post("/v1/completions", json=LONG))
        async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as stream:
            assert stream.status_code == 200
            chunks = stream.aiter_bytes()
            first = await read_events(chunks, 3)
            act()
            acted = time.monotonic()
            body = first + await read_rest(chunks)
        whole_response = await whole
        elapsed = time.monotonic() - acted
        health = (await client.get("/health")).status_code
    return body.split(b"\n\n"), whole_response, elapsed, health


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_dead_or_hung_worker_fails_requests_and_the_server_exits(
    model_dir: Callable[[str], Path], fault: str
) -> None:
    with server_process(
        model_dir("llama"), "--served-model-name", MODEL, "--num-pages", "256", "--max-num-seqs", "1",
        "--tensor-parallel-size", "2", "--distributed-timeout", "3", "--log-level", "warning",
    ) as server:  # fmt: skip
        engine = server.engine_pid()
        (worker,) = server.worker_pids()
        sig = signal.SIGKILL if fault == "killed" else signal.SIGSTOP
        frames, whole, elapsed, health = asyncio.run(_stream_then(server.base_url, lambda: os.kill(worker, sig)))
        # A killed peer fails the next collective at once; a hung one after --distributed-timeout.
        assert elapsed < (5 if fault == "killed" else 3 + 5), "in-flight requests must end promptly"
        assert frames[-2:] == [b"data: [DONE]", b""]
        error = json.loads(frames[-3].removeprefix(b"data: "))["error"]
        assert error["code"] == "engine_error" and error["type"] == "server_error"
        assert whole.status_code == 500 and whole.json()["error"]["code"] == "engine_error"
        assert health == 503
        assert server.process.wait(timeout=30) != 0
        assert "tensor-parallel" in server.log() and "a peer rank died or hung" in server.log()
    for pid in (engine, worker):
        deadline = time.monotonic() + 10
        while not process_gone(pid):
            assert time.monotonic() < deadline, f"process {pid} outlived the server"
            time.sleep(0.05)
