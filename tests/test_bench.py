"""Smoke tests of `ferry bench`: small sizes, report structure and the greedy equality check; never a timing."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from bench.cli import main
from bench.decode import DecodeOptions, format_decode, run_decode
from bench.embed import (
    EMBED_SHAPES,
    CosineMismatch,
    SystemResult,
    check_tokenization,
    compare_vectors,
    embedder_tokenizer,
    format_embed,
    make_inputs,
)
from bench.llama_cpp import gguf_type, llama_server_command
from bench.models import NAMED_CONFIGS, prepare_model
from bench.offline import SYSTEMS, OfflineOptions, TokenMismatch, compare_tokens, format_offline, run_offline
from bench.overhead import OverheadOptions, format_overhead, run_overhead
from bench.results import RequestTrace, SystemRun, assign_slots
from bench.serve import ServeOptions, format_serve, percentile, run_serve
from bench.workload import LengthDist, WorkloadSpec, make_workload

SMALL = WorkloadSpec(
    num_requests=6,
    prompt_len=LengthDist.parse("uniform:3:20"),
    output_len=LengthDist.parse("pareto:2:24:1.2"),
    seed=3,
)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matmuls gain nothing from threads, and on a shared 2-core runner threads contend: 1 is fastest."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- workloads -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "low", "high"),
    [("fixed:7", 7, 7), ("uniform:4:9", 4, 9), ("lognormal:32:1.0:100", 1, 100), ("pareto:8:64", 8, 64)],
)
def test_length_distributions_stay_in_range_and_are_seeded(spec: str, low: int, high: int) -> None:
    dist = LengthDist.parse(spec)
    draws = [dist.sample(random.Random(5)) for _ in range(3)]
    assert len(set(draws)) == 1  # same seed, same draw
    values = [dist.sample(rng) for rng in [random.Random(0)] for _ in range(500)]
    assert all(low <= v <= high for v in values)
    assert str(LengthDist.parse(str(dist))) == str(dist)


@pytest.mark.parametrize("spec", ["gauss:3", "fixed", "uniform:9:4", "pareto:0:10", "uniform:a:b"])
def test_bad_length_specs_are_rejected(spec: str) -> None:
    with pytest.raises(ValueError):
        LengthDist.parse(spec)


def test_workload_is_seeded_and_shares_its_prefix() -> None:
    spec = WorkloadSpec(num_requests=5, prefix_len=12, seed=1)
    a, b = make_workload(spec, vocab_size=100), make_workload(spec, vocab_size=100)
    assert a == b
    assert all(p[:12] == a.prompts[0][:12] and len(p) > 12 for p in a.prompts)
    assert all(0 <= t < 100 for p in a.prompts for t in p)
    assert a.total_output_tokens == sum(a.output_lens)


def test_slots_are_reused_first_fit() -> None:
    traces = [RequestTrace(0, 0, 3, 3), RequestTrace(1, 0, 1, 1), RequestTrace(2, 1, 2, 2), RequestTrace(3, 2, 4, 4)]
    assert assign_slots(traces) == 2
    assert [t.slot for t in traces] == [0, 1, 1, 1]


# -- offline -------------------------------------------------------------------------------------------------


def _run(system: str, tokens: list[list[int]]) -> SystemRun:
    return SystemRun(system, 1.0, tokens, [])


def test_equality_check_finds_the_first_differing_token() -> None:
    runs = [_run("static", [[1, 2, 3], [4]]), _run("ferry", [[1, 2, 3], [4]]), _run("x", [[1, 9, 3], [4, 5]])]
    assert compare_tokens(runs[:2]) == []
    assert compare_tokens(runs) == [
        {"request": 0, "systems": ["static", "x"], "first_difference": 1, "lengths": [3, 3]},
        {"request": 1, "systems": ["static", "x"], "first_difference": 1, "lengths": [1, 2]},
    ]


IN_PROCESS = tuple(system for system in SYSTEMS if system != "vllm")
"""Every system but vLLM, which runs in an interpreter of its own (tested below when one is given)."""


def test_offline_runs_every_system_with_identical_tokens(tiny_llama: Path, tmp_path: Path) -> None:
    options = OfflineOptions(
        model=str(tiny_llama),
        device="cpu",
        workload=SMALL,
        batch_size=3,
        # Smaller than the longest prompt: Ferry's chunked prefill is part of what must agree.
        max_batch_tokens=16,
        page_size=4,
        warmup=False,
        plot=tmp_path / "timeline.png",
        systems=IN_PROCESS,
    )
    report = run_offline(options)
    assert report["check"]["identical"] is True
    assert report["check"]["systems"] == list(IN_PROCESS)
    systems = report["systems"]
    expected = sum(report["workload"]["output_lens"])
    for name in IN_PROCESS:
        assert systems[name]["generated_tokens"] == expected
        assert len(systems[name]["traces"]) == SMALL.num_requests
    assert systems["static"]["details"]["waves"] == 2
    assert set(report["ratios"]["ferry"]) == set(IN_PROCESS) - {"ferry"}
    assert report["floor"]["steps"] == systems["ferry"]["details"]["steps"]
    assert report["efficiency"] > 0
    assert (tmp_path / "timeline.png").stat().st_size > 0
    table = format_offline(report)
    for label in ("static", "transformers-cb", "ferry", "model floor", "identical"):
        assert label in table
    json.dumps(report)  # everything in the report is JSON-serialisable


def _two_systems(model: Path, **options: object) -> OfflineOptions:
    """transformers' continuous batching and Ferry on the small workload, no warm-up."""
    base = dict(model=str(model), device="cpu", workload=SMALL, batch_size=3, page_size=4, warmup=False)
    return OfflineOptions(**base, systems=("transformers-cb", "ferry"), **options)  # type: ignore[arg-type]


def test_vllm_without_its_python_is_skipped_with_a_note(tiny_llama: Path) -> None:
    report = run_offline(dataclasses.replace(_two_systems(tiny_llama, floor=False), systems=("vllm", "ferry")))
    assert set(report["systems"]) == {"ferry"}
    assert report["skipped"] == {"vllm": "no --vllm-python given"}
    assert "vllm skipped: no --vllm-python given" in format_offline(report)


@pytest.mark.skipif(not os.environ.get("FERRY_VLLM_PYTHON"), reason="set FERRY_VLLM_PYTHON to vLLM's interpreter")
def test_vllm_offline_agrees_with_ferry() -> None:
    # The benchmark's own tiny Llama (head_dim 64): vLLM's CPU attention has no kernel for the test models' 16.
    options = OfflineOptions(
        model="tiny-llama",
        device="cpu",
        dtype="float32",
        workload=SMALL,
        batch_size=3,
        warmup=False,
        floor=False,
        systems=("vllm", "ferry"),
        vllm_python=Path(os.environ["FERRY_VLLM_PYTHON"]),
    )
    report = run_offline(options)
    assert report["check"]["identical"] is True and set(report["systems"]) == {"vllm", "ferry"}
    assert report["systems"]["vllm"]["generated_tokens"] == sum(report["workload"]["output_lens"])


def test_offline_repeats_report_the_median_run_and_profile_ferry(tiny_llama: Path, tmp_path: Path) -> None:
    report = run_offline(_two_systems(tiny_llama, repeat=3, profile=tmp_path / "ops.txt"))
    ops = (tmp_path / "ops.txt").read_text()
    assert "Self CPU" in ops and "aten::" in ops
    assert report["settings"]["repeat"] == 3
    for run in report["systems"].values():
        walls = run["details"]["repeat_wall_seconds"]
        assert len(walls) == 3
        assert run["wall_seconds"] == sorted(walls)[1]
    assert report["floor"]["steps"] == report["systems"]["ferry"]["details"]["steps"]
    assert "median of 3" in format_offline(report)


def test_offline_repeats_must_agree_with_themselves(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.offline

    real = bench.offline.run_hf_continuous
    calls: list[SystemRun] = []

    def drifting(*args, **kwargs):
        run = real(*args, **kwargs)
        calls.append(run)
        if len(calls) == 2:
            run.tokens[0] = [*run.tokens[0][:-1], run.tokens[0][-1] + 1]
        return run

    monkeypatch.setattr(bench.offline, "run_hf_continuous", drifting)
    with pytest.raises(TokenMismatch, match="two repeats"):
        run_offline(_two_systems(tiny_llama, repeat=2, floor=False))


def test_offline_mismatch_fails_before_any_figure(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.offline

    real = bench.offline.run_static

    def corrupted(*args: object, **kwargs: object) -> SystemRun:
        run = real(*args, **kwargs)
        run.tokens[0][0] += 1
        return run

    monkeypatch.setattr(bench.offline, "run_static", corrupted)
    options = OfflineOptions(
        model=str(tiny_llama),
        device="cpu",
        workload=SMALL,
        batch_size=3,
        warmup=False,
        floor=False,
        systems=("static", "ferry"),
    )
    with pytest.raises(TokenMismatch, match="request 0: static vs ferry differ at token 0"):
        run_offline(options)


@pytest.mark.parametrize(("name", "positions"), [("ferry-demo-512", 512), ("ferry-demo-2048-nocopy", 2048)])
def test_earlier_demo_models_stay_reachable_by_name(name: str, positions: int, tmp_path: Path) -> None:
    """The demo models of earlier BENCHMARKS.md rows load by name, weights and tokenizer included, and are not
    the embedded model of today."""
    loaded = prepare_model(name, tmp_path)
    assert loaded.has_weights and loaded.hf.config.max_position_embeddings == positions
    assert (loaded.path / "tokenizer.json").is_file()
    shipped = Path(__file__).resolve().parents[1] / "server" / "default_model" / "model.safetensors"
    assert (loaded.path / "model.safetensors").read_bytes() != shipped.read_bytes()


def test_offline_command_on_a_named_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "offline.json"
    status = main(
        [
            "offline",
            "--model",
            "tiny-llama",
            "--device",
            "cpu",
            "--num-requests",
            "4",
            "--prompt-len",
            "uniform:4:12",
            "--output-len",
            "fixed:3",
            "--batch-size",
            "2",
            "--no-warmup",
            "--json",
            str(out),
        ]
    )
    assert status == 0
    assert "gen tok/s" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["model"]["name"] == "tiny-llama"
    assert report["check"]["identical"] is True
    assert {"date", "command", "machine"} <= set(report)


# -- overhead ------------------------------------------------------------------------------------------------


def test_overhead_reports_microseconds_per_step() -> None:
    report = run_overhead(OverheadOptions(sizes=(4, 16), steps=5, prompt_len=6, page_size=4))
    assert [r["running_sequences"] for r in report["results"]] == [4, 16]
    for result in report["results"]:
        assert len(result["step_seconds"]) == 5
        assert result["us_per_step_mean"] > 0
        assert set(result["breakdown_us"]) == {"schedule", "prepare", "forward", "sample", "update", "other"}
    assert "running seqs" in format_overhead(report)


# -- serve ---------------------------------------------------------------------------------------------------


def _fake_server(chunk_gap: float) -> httpx.MockTransport:
    """An OpenAI-style completions stream: one chunk per token, then usage, then [DONE]; 3-token prompts fail."""

    async def stream(n: int) -> AsyncIterator[bytes]:
        for i in range(n):
            await asyncio.sleep(chunk_gap)
            yield f'data: {{"choices": [{{"index": 0, "text": "t{i}"}}]}}\n\n'.encode()
        yield f'data: {{"choices": [], "usage": {{"completion_tokens": {n}}}}}\n\n'.encode()
        yield b"data: [DONE]\n\n"

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake"}]})
        body = json.loads(request.content)
        assert body["stream"] is True and body["ignore_eos"] is True and isinstance(body["prompt"], list)
        if len(body["prompt"]) == 3:
            return httpx.Response(500, json={"error": "boom"})
        return httpx.Response(200, content=stream(body["max_tokens"]), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def test_serve_metrics_follow_vllm_definitions() -> None:
    workload = WorkloadSpec(
        num_requests=4, prompt_len=LengthDist.parse("uniform:3:6"), output_len=LengthDist.parse("fixed:4"), seed=2
    )
    prompts = make_workload(workload, 256).prompts
    options = ServeOptions(url="http://fake", workload=workload, concurrencies=(1, 2), rates=(float("inf"),))
    report = run_serve(options, transport=_fake_server(chunk_gap=0.01))
    assert report["model"] == "fake"
    assert [(p["mode"], p["load"]) for p in report["points"]] == [
        ("concurrency", 1),
        ("concurrency", 2),
        ("request_rate", float("inf")),
    ]
    failing = sum(len(p) == 3 for p in prompts)
    assert 0 < failing < 4
    for point in report["points"]:
        assert point["completed"] + point["errors"] == 4
        assert point["errors"] == failing
        assert point["output_tokens"] == 4 * point["completed"]
        for sample in point["samples"]:
            if sample["error"] is None:
                assert len(sample["itl"]) == 3  # gaps between 4 token chunks; the usage chunk carries no choice
                assert sample["ttft"] <= sample["latency"]
        assert point["tpot_ms"]["p50"] > 0 and point["itl_ms"]["p99"] >= point["itl_ms"]["p50"]
    assert "TTFT ms p50/90/99" in format_serve(report)


def test_serve_command_against_a_started_ferry_server(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    status = main([
        "serve", "--model", str(tiny_llama), "--num-requests", "3", "--prompt-len", "uniform:3:8",
        "--output-len", "fixed:4", "--concurrency", "1,3", "--request-rate", "inf", "--json", str(out),
    ])  # fmt: skip
    assert status == 0
    report = json.loads(out.read_text())
    assert len(report["points"]) == 3
    for point in report["points"]:
        assert (point["completed"], point["errors"], point["output_tokens"]) == (3, 0, 12)
        # ITL counts gaps between chunks; a chunk may carry several tokens (text held back until it decodes).
        assert len(point["samples"]) == 3 and all(len(s["itl"]) <= 3 for s in point["samples"])


@pytest.mark.skipif(not os.environ.get("FERRY_VLLM_PYTHON"), reason="set FERRY_VLLM_PYTHON to vLLM's interpreter")
def test_serve_command_against_a_started_vllm_server(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    # vLLM's CPU attention has no kernel for the test models' head_dim 16: the embedded demo model it is.
    demo = Path(__file__).resolve().parents[1] / "server" / "default_model"
    status = main([
        "serve", "--model", str(demo), "--server", "vllm", "--vllm-python", os.environ["FERRY_VLLM_PYTHON"],
        "--server-arg=--dtype=float32", "--num-requests", "3", "--prompt-len", "uniform:3:8",
        "--output-len", "fixed:4", "--concurrency", "3", "--json", str(out),
    ])  # fmt: skip
    assert status == 0
    (point,) = json.loads(out.read_text())["points"]
    assert (point["completed"], point["errors"], point["output_tokens"]) == (3, 0, 12)


def test_serve_needs_vllms_python_to_start_vllm(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="--vllm-python"):
        run_serve(ServeOptions(model=str(tiny_llama), server="vllm"))


def test_serve_needs_the_llama_cpp_folder_to_start_llama_cpp(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="--llama-cpp"):
        run_serve(ServeOptions(model=str(tiny_llama), server="llama.cpp"))


def test_llama_server_gets_a_conversion_at_the_models_own_precision(tmp_path: Path) -> None:
    """The GGUF type follows config.json's dtype; the server one slot per client and the longest request's context
    for each; the extra arguments last, so `-t 2` overrides."""
    demo = Path(__file__).resolve().parents[1] / "server" / "default_model"
    assert gguf_type(demo) == "f32"
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    (bf16 / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    assert gguf_type(bf16) == "bf16"
    (bf16 / "config.json").write_text(json.dumps({"dtype": "int8"}))
    with pytest.raises(ValueError, match="no GGUF type"):
        gguf_type(bf16)
    command = llama_server_command(
        tmp_path, tmp_path / "m.gguf", 8123, slots=4, context_per_slot=300, extra=["-t", "2"]
    )
    assert command[0] == str(tmp_path / "bin" / "llama-server")
    assert command[command.index("--parallel") + 1] == "4" and command[command.index("-c") + 1] == "1200"
    assert command[-2:] == ["-t", "2"]


@pytest.mark.skipif(
    not os.environ.get("FERRY_LLAMA_CPP"), reason="set FERRY_LLAMA_CPP to install-llama-cpp.sh's folder"
)
def test_serve_command_against_a_started_llama_cpp_server(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    demo = Path(__file__).resolve().parents[1] / "server" / "default_model"
    status = main([
        "serve", "--model", str(demo), "--server", "llama.cpp", "--llama-cpp", os.environ["FERRY_LLAMA_CPP"],
        "--num-requests", "3", "--prompt-len", "uniform:3:8", "--output-len", "fixed:4", "--concurrency", "3",
        "--json", str(out),
    ])  # fmt: skip
    assert status == 0
    (point,) = json.loads(out.read_text())["points"]
    assert (point["completed"], point["errors"], point["output_tokens"]) == (3, 0, 12)


def test_serve_sends_a_constraint_in_place_of_ignore_eos(tmp_path: Path) -> None:
    bodies: list[dict[str, object]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake"}]})
        bodies.append(json.loads(request.content))
        events = b'data: {"choices": [{"index": 0, "text": "{"}]}\n\ndata: [DONE]\n\n'
        return httpx.Response(200, content=events, headers={"content-type": "text/event-stream"})

    schema = json.loads((Path(__file__).resolve().parents[1] / "bench" / "schemas" / "trips.json").read_text())
    workload = WorkloadSpec(
        num_requests=2, prompt_len=LengthDist.parse("fixed:4"), output_len=LengthDist.parse("fixed:4")
    )
    options = ServeOptions(
        url="http://fake", workload=workload, concurrencies=(2,), structured_outputs={"json": schema}
    )
    report = run_serve(options, transport=httpx.MockTransport(handler))
    assert len(bodies) == 3, "the warm-up request and the two measured ones"
    assert all(body["structured_outputs"] == {"json": schema} and "ignore_eos" not in body for body in bodies)
    assert "constrained: json" in format_serve(report)
    with pytest.raises(SystemExit):
        main(["serve", "--url", "http://fake", "--schema", str(tmp_path / "s.json")])


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_counts_a_tied_table_once_whatever_the_heads_layout(monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    """A tied table is the head's read, whether the embedding reads rows through the head (one copy) or keeps a
    plain copy of its own beside oneDNN's packed head (bfloat16 on a CPU that multiplies it): never counted twice."""
    config = {**NAMED_CONFIGS["tiny-llama"], "tie_word_embeddings": True}
    monkeypatch.setitem(NAMED_CONFIGS, "tiny-llama-tied", config)
    options = DecodeOptions(model="tiny-llama-tied", sizes=(1,), context_len=8, steps=2, page_size=8, device="cpu",
                            dtype=dtype)  # fmt: skip
    hidden, inter, vocab, layers = (
        config[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers")
    )
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    [result] = run_decode(options)["results"]
    element = 4 if dtype == "float32" else 2
    assert result["weight_bytes"] == element * (layers * per_layer + hidden + vocab * hidden)


def test_decode_reports_step_times_and_the_bytes_each_step_reads() -> None:
    options = DecodeOptions(
        model="tiny-llama", sizes=(1, 3), context_len=20, steps=3, page_size=8, device="cpu", graphs=("on", "off")
    )
    report = run_decode(options)
    config = NAMED_CONFIGS["tiny-llama"]
    hidden, inter, vocab, layers = (
        config[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers")
    )
    # Untied: the LM head is read, the embedding table is not; norms are hidden-sized vectors.
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    expected_weights = 4 * (layers * per_layer + hidden + vocab * hidden)
    assert [(r["batch"], r["graphs"]) for r in report["results"]] == [(1, "on"), (1, "off"), (3, "on"), (3, "off")]
    for r in report["results"]:
        assert r["weight_bytes"] == expected_weights
        mean_context = 20 + 3 + (3 - 1) / 2  # the keys the three timed steps read: 23, 24, 25
        assert r["kv_bytes"] == pytest.approx(r["batch"] * mean_context * 2 * layers * hidden * 4)
        assert r["ms_per_step_p50"] > 0 and r["roofline_fraction"] > 0
        assert not r["cuda_graphs_used"], "no CUDA graphs on CPU"
    assert report["settings"]["bandwidth_source"] == "measured copy"
    assert "roofline" in format_decode(report)


# -- the GPU script ------------------------------------------------------------------------------------------


def test_gpu_script_is_valid_bash_and_every_bench_command_parses(tmp_path: Path) -> None:
    """The GPU script runs where no one can fix it mid-run: its shell must parse and every `bench` command in it
    must be one the CLI accepts, with the values its variables take there."""
    import argparse
    import shlex
    import subprocess

    from bench.cli import add_bench_subcommands

    script = Path(__file__).parent.parent / "scripts" / "gpu_bench.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text().replace("\\\n", " ")
    commands = [line.split("-m bench", 1)[1] for line in text.splitlines() if '"$PY" -m bench' in line]
    parser = argparse.ArgumentParser()
    add_bench_subcommands(parser)
    parsed = [
        parser.parse_args(shlex.split(command.replace('"$shape"', "qwen3-4b").replace("$OUT", str(tmp_path))))
        for command in commands
    ]
    assert [args.bench_command for args in parsed] == ["offline"] * 7 + ["decode"] * 2
    assert all(args.json.parent == tmp_path for args in parsed)
    assert [args.enforce_eager for args in parsed[:7]] == [False, False, True, False, False, True, False]
    assert [args.async_scheduling for args in parsed[:7]] == [False, False, False, True, False, False, False]
    assert parsed[6].model == "qwen3-30b-a3b-2l" and parsed[6].systems == "transformers-cb,ferry"
    assert all(args.page_size == 16 for args in parsed)
    decode, fp8 = parsed[7], parsed[8]
    assert decode.sizes == (1, 16, 64, 256) and decode.graphs == ("on", "off") and decode.device == "cuda"
    assert fp8.quantization == ("none", "fp8") and fp8.kv_cache_dtype == ("auto", "fp8") and fp8.device == "cuda"
    # The TP step runs on machines with several GPUs only; the decode step runs once per shape.
    limits = {name: int(limit) for name, limit in re.findall(r"^\s*step (\S+) (\d+) ", text, flags=re.MULTILINE)}
    runs = {name: 2 if "$shape" in name else 1 for name in limits if not name.startswith("tp-")}
    assert sum(limits[name] * n for name, n in runs.items()) <= 600, "the steps' limits must fit 10 minutes"


def test_gpu_script_runs_tensor_parallelism_only_with_several_gpus(tmp_path: Path) -> None:
    """The TP step (`ferry bench tp`, NCCL) parses, and is guarded by the machine's GPU count."""
    import argparse
    import shlex

    from bench.cli import add_bench_subcommands

    script = (Path(__file__).parent.parent / "scripts" / "gpu_bench.sh").read_text()
    text = script.replace("\\\n", " ")
    (command,) = [line.split('"$PY" -m ferry ', 1)[1] for line in text.splitlines() if '"$PY" -m ferry bench' in line]
    guard = text[: text.index(command)].rsplit("\nif ", 1)[1]
    assert guard.startswith('[ "$GPUS" -gt 1 ]') and "GPUS=$(nvidia-smi -L" in text
    words = shlex.split(command.replace("$OUT", str(tmp_path)))
    assert words[0] == "bench"
    parser = argparse.ArgumentParser()
    add_bench_subcommands(parser)
    args = parser.parse_args(words[1:])
    assert args.bench_command == "tp" and args.tensor_parallel_size == 2 and args.device == "cuda"
    assert args.json.parent == tmp_path


def test_matmul_floor_times_every_gemm_of_ferrys_steps(tiny_llama: Path) -> None:
    options = _two_systems(tiny_llama, max_batch_tokens=16, floor=False, matmul_floor=True)
    report = run_offline(dataclasses.replace(options, systems=("ferry",)))
    config = json.loads((tiny_llama / "config.json").read_text())
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * hidden // config["num_attention_heads"]
    per_token = config["num_hidden_layers"] * hidden * ((hidden + 2 * kv) + hidden + 2 * inter + inter)
    prompts, outputs = report["workload"]["prompt_lens"], report["workload"]["output_lens"]
    # No prefix hits or preemptions here: every prompt token and every generated token but the last is computed
    # once; every generated token is sampled from the LM head once.
    computed = sum(prompts) + sum(outputs) - len(outputs)
    want_gflop = 2 * (computed * per_token + sum(outputs) * hidden * vocab) / 1e9
    floor = report["matmul_floor"]
    assert floor["gflop"] == pytest.approx(want_gflop)
    assert floor["seconds"] > 0 and report["matmul_fraction"] > 0
    assert set(floor["implementations"].values()) <= {"model's layer", "F.linear"}
    assert "matmul floor" in format_offline(report)


def test_the_floors_replay_the_steps_of_the_reported_repeat(tiny_llama: Path) -> None:
    """Repeats after the first hit the prefix cache it filled, so they compute fewer tokens: the floors replay the
    steps of the repeat whose wall time is reported, not the first one's."""
    options = _two_systems(tiny_llama, max_batch_tokens=16, repeat=3, floor=True, matmul_floor=True)
    report = run_offline(dataclasses.replace(options, systems=("ferry",)))
    details = report["systems"]["ferry"]["details"]
    prompts, outputs = report["workload"]["prompt_lens"], report["workload"]["output_lens"]
    cold = sum(prompts) + sum(outputs) - len(outputs)
    # Whichever repeat is the median (most often a warm one), the floor computes what it computed.
    assert report["floor"]["steps"] == details["steps"]
    assert report["floor"]["tokens_computed"] == cold - details["prefix_cache_hits"]


# -- embed ---------------------------------------------------------------------------------------------------


def _embed_command(tmp_path: Path, systems: str, *extra: str) -> dict[str, object]:
    out = tmp_path / "embed.json"
    status = main([
        "embed", "--model", "tiny-bert", "--num-inputs", "10", "--min-len", "4", "--max-len", "40",
        "--systems", systems, "--batch-size", "4", "--concurrency", "2", "--check-inputs", "4",
        "--workdir", str(tmp_path), "--json", str(out), *extra,
    ])  # fmt: skip
    assert status == 0
    return json.loads(out.read_text())


def test_embed_command_runs_ferrys_server_and_sentence_transformers_on_the_same_inputs(tmp_path: Path) -> None:
    report = _embed_command(tmp_path, "ferry,st")
    assert set(report["systems"]) == {"ferry@float32", "st@float32"}
    assert (
        report["inputs"]["count"] == 10 and 4 <= report["inputs"]["min_tokens"] <= report["inputs"]["max_tokens"] <= 40
    )
    for label, cosine in report["check"]["min_cosine"].items():
        assert cosine > 0.999 and report["check"]["max_distance"][label] < report["check"]["nearest_other_input"] / 2
    st = report["systems"]["st@float32"]
    assert st["ferry_ratio"] == pytest.approx(st["wall_seconds"] / report["systems"]["ferry@float32"]["wall_seconds"])
    assert "Ferry / this" in format_embed(report)


@pytest.mark.skipif(not os.environ.get("FERRY_VLLM_PYTHON"), reason="set FERRY_VLLM_PYTHON to vLLM's interpreter")
def test_embed_command_against_vllms_pooling_runner(tmp_path: Path) -> None:
    report = _embed_command(tmp_path, "ferry,vllm", "--vllm-python", os.environ["FERRY_VLLM_PYTHON"])
    assert set(report["systems"]) == {"ferry@float32", "vllm@float32"} and report["skipped"] == {}


def test_embed_check_refuses_vectors_of_other_inputs(tmp_path: Path) -> None:
    """Mean pooling over random tokens leaves different inputs' vectors close: the check must still catch a mix-up."""
    reference = np.random.default_rng(0).normal(size=(4, 8)) + 20.0  # nearly parallel, as mean-pooled vectors are
    mixed = SystemResult("ferry", "float32", 1.0, np.roll(reference, 1, axis=0))
    assert compare_vectors([SystemResult("st", "float32", 1.0, reference)], reference, [0, 1, 2, 3], 0.99)
    with pytest.raises(CosineMismatch, match="ferry@float32"):
        compare_vectors([mixed], reference, [0, 1, 2, 3], 0.99)


@pytest.mark.parametrize("model", ["tiny-bert", "qwen3-embedding-0.6b"])
def test_embed_texts_tokenize_to_the_ids_the_servers_get(model: str, tmp_path: Path) -> None:
    shape = EMBED_SHAPES[model]
    embedder_tokenizer(shape, 512).save_pretrained(tmp_path)
    inputs = make_inputs(shape, 6, 5, 30, seed=1)
    assert inputs == make_inputs(shape, 6, 5, 30, seed=1)
    assert all(5 <= len(ids) <= 30 for ids in inputs.ids)
    check_tokenization(tmp_path, inputs)
    with pytest.raises(RuntimeError, match="input 0"):
        check_tokenization(tmp_path, dataclasses.replace(inputs, ids=[ids[::-1] for ids in inputs.ids]))


def test_spec_bench_alternates_its_servers_over_every_workload() -> None:
    """Two real servers of the demo model (one drafting), every workload at each concurrency, medians over the
    rounds; `repeat` holds only conversations whose second answer repeated the first, and drafts from the first
    answer are accepted there."""
    from bench.perplexity import DEMO_MODEL
    from bench.spec import SpecOptions, format_spec, run_spec

    options = SpecOptions(model=str(DEMO_MODEL), concurrencies=(1, 2), rounds=2, num_requests=3, max_tokens=12)
    report = run_spec(options)
    rows = report["rows"]
    assert [(r["workload"], r["concurrency"]) for r in rows] == [
        (w, c) for w in ("repeat", "predict", "ask-again", "chat") for c in (1, 2)
    ]
    assert report["repeating"]["found"] == 16 and report["repeating"]["asked"] >= 16
    assert all(r["rounds"] == 2 and r["tokens_per_s_off"] > 0 and r["tokens_per_s_on"] > 0 for r in rows)
    assert all(r["acceptance"] is None or 0 <= r["acceptance"] <= 1 for r in rows)
    repeat = [r for r in rows if r["workload"] in ("repeat", "predict")]
    assert all(r["drafted_tokens"] > 0 and r["acceptance"] > 0.5 for r in repeat), repeat
    table = format_spec(report)
    assert "on/off" in table and "ask-again" in table and "16 repeating conversations" in table


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_images_bench_runs_ferry_and_transformers_on_the_same_requests(family: str, tmp_path: Path) -> None:
    """`ferry bench images`' systems on a tiny model of each benchmarked family: the same greedy tokens, and with
    one image repeated, Ferry encodes it once (its encoder cache serves the rest)."""
    from bench.cli import IMAGE_SHAPE_NAMES
    from bench.images import IMAGE_SHAPES, make_workload, run_ferry, run_transformers
    from tests.vision_models import BUILDERS

    assert set(IMAGE_SHAPE_NAMES) == set(IMAGE_SHAPES)
    path = BUILDERS[family](tmp_path / family)
    workload = make_workload(path, 3, 40, 5, 4, distinct=1, seed=0)
    warm = make_workload(path, 2, 40, 5, 4, distinct=2, seed=1)
    _, ferry, cache = run_ferry(path, workload, warm, "float32", 2048)
    _, transformers = run_transformers(path, workload, torch.float32)
    assert ferry == transformers
    assert cache == {"encoded": 1, "encoder_cache_hits": 2}
