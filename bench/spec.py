"""`ferry bench spec`: speculative decoding against none, side by side in one run, on three chat workloads.

Two Ferry servers of the same model run at once (one with --speculative-config, one without; each idles while the
other is measured), and every load point alternates between them for `rounds` rounds: the figures are medians
over rounds, so that this machine's drift does not decide a ratio. The workloads are built from the model's own
answers (greedy, from the server without drafts), so that what repeats is what this model says:

- `repeat`: the user asks a question, gets the model's answer, and asks the same question again: an answer that
  repeats text of its prompt (as edits, extraction and summaries do);
- `predict`: the same conversations with OpenAI's `prediction` set to the earlier answer (Predicted Outputs),
  against the same conversations without it, both on the server without --speculative-config;
- `chat`: fresh questions, nothing to copy from.

Each point is a closed loop of C clients over the workload's requests (greedy, streamed chat completions): output
tokens/s, TTFT and ITL medians, and the drafted tokens' acceptance from the server's /metrics.

`--draft-pair` measures the draft-model path instead: the served model is a wider, deeper Llama of the demo's
tokenizer with random weights (`draft_pair_target`, about 10x the demo's cost per token), drafted for by the demo
model itself (`method: draft_model`), on the repeat and chat workloads. Random weights leave little to accept: the
row shows what a poor draft costs once the engine measures it (the gate), and the acceptance it met.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.perplexity import DEMO_MODEL
from bench.report import fmt, format_table, stamp
from bench.serve import RequestSample, ServeOptions, _local_server, closed_loop, summarize

SUBJECTS = (
    "os.path.join", "a file descriptor", "fork", "a socket", "a ferry", "memory allocation", "a list", "a dictionary",
    "the garbage collector", "a generator", "asyncio", "a thread", "a lock", "json.dumps", "a tuple", "subprocess",
    "a decorator", "an iterator", "the GIL", "a context manager", "pathlib", "a set", "a lambda", "an exception",
    "a module", "a class", "a coroutine", "a pipe", "a signal", "a string", "bytes", "a harbour",
)  # fmt: skip
QUESTIONS = (
    "What is {}?", "How do I use {}?", "Tell me about {}.", "Explain {} briefly.", "Why would I use {}?",
    "Give an example of {}.", "What does {} do?", "Describe {} in one sentence.",
)  # fmt: skip


@dataclass(frozen=True)
class SpecOptions:
    model: str
    speculative_config: str = '{"method": "ngram", "num_speculative_tokens": 8}'
    concurrencies: tuple[int, ...] = (1, 4, 32)
    rounds: int = 5
    num_requests: int = 32
    """Requests per load point, at least four times its concurrency."""
    max_tokens: int = 128
    timeout: float = 600.0
    draft_pair: Path | None = None
    """Set: measure the draft-model pair built in this folder (module docstring) instead of `model`."""


PAIR_TARGET = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12)
"""The draft pair's served model: the demo's architecture widened and deepened (about 75M parameters, 18x the
demo's 4M; a decode step about 10x the demo's time on a 2-core CPU)."""


def draft_pair_target(folder: Path) -> Path:
    """The draft pair's served model in `folder` (built once, seed 0): random weights, the demo's tokenizer and
    chat template, so that the demo model can draft for it."""
    target = folder / "draft-pair-target"
    if (target / "model.safetensors").exists():
        return target
    config = AutoConfig.from_pretrained(DEMO_MODEL)
    for key, value in PAIR_TARGET.items():
        setattr(config, key, value)
    config.num_key_value_heads = 4
    config.head_dim = 64
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.02)
    model.save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        (target / name).write_bytes((DEMO_MODEL / name).read_bytes())
    return target


def _questions(count: int, offset: int) -> list[str]:
    texts = [q.format(s) for q in QUESTIONS for s in SUBJECTS]
    return [texts[(offset + i) % len(texts)] for i in range(count)]


async def _chat(client: httpx.AsyncClient, url: str, body: dict[str, Any], origin: float, index: int) -> RequestSample:
    sample = RequestSample(index, 0, time.perf_counter() - origin)
    sent = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                sample.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"
                return sample
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                data = json.loads(line[5:])
                now = time.perf_counter()
                if data.get("choices") and data["choices"][0]["delta"].get("content"):
                    last = sample.on_token_chunk(now, sent, last)
                if data.get("usage"):
                    last = now if sample.ttft is None else last  # an empty answer ends with its usage
                    usage = data["usage"]
                    details = usage.get("completion_tokens_details") or {}
                    # Rejected prediction tokens are billed in completion_tokens: not output a user sees.
                    sample.output_tokens = usage["completion_tokens"] - details.get("rejected_prediction_tokens", 0)
                    sample.prompt_tokens = usage["prompt_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
        return sample
    if sample.ttft is None:
        sample.ttft = last - sent  # the model ended at once (EOS first): an answer too, of no content
    sample.latency = last - sent
    return sample


async def _closed_loop(
    url: str, bodies: list[dict[str, Any]], concurrency: int, timeout: float
) -> tuple[list[RequestSample], float]:
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        return await closed_loop(
            len(bodies), concurrency, lambda index, origin: _chat(client, url, bodies[index], origin, index)
        )


def _drafting(url: str) -> tuple[float, float]:
    """(accepted, drafted) tokens so far, from the server's /metrics.json (the JSON twin of /metrics)."""
    snapshot = httpx.get(f"{url}/metrics.json", timeout=10).json()
    return snapshot["spec_decode_num_accepted_tokens_total"], snapshot["spec_decode_num_draft_tokens_total"]


def _body(model: str, messages: list[dict[str, str]], max_tokens: int, prediction: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if prediction is not None:
        body["prediction"] = {"type": "content", "content": prediction}
    return body


def _answers(url: str, model: str, questions: list[str], max_tokens: int) -> list[str]:
    answers = []
    with httpx.Client(timeout=600) as client:
        for q in questions:
            body = {"model": model, "messages": [{"role": "user", "content": q}], "max_tokens": max_tokens}
            response = client.post(f"{url}/v1/chat/completions", json={**body, "temperature": 0})
            response.raise_for_status()
            answers.append(response.json()["choices"][0]["message"]["content"] or "")
    return answers


def run_spec(options: SpecOptions) -> dict[str, Any]:
    model_dir, speculative_config = options.model, options.speculative_config
    if options.draft_pair is not None:
        model_dir = str(draft_pair_target(options.draft_pair))
        speculative_config = json.dumps(
            {"method": "draft_model", "model": str(DEMO_MODEL), "num_speculative_tokens": 4}
        )
    base = ServeOptions(model=model_dir, startup_timeout=300.0)
    drafting_args = ("--speculative-config", speculative_config)
    with _local_server(base) as off_url, _local_server(replace(base, server_args=drafting_args)) as on_url:
        model = httpx.get(f"{off_url}/v1/models", timeout=10).json()["data"][0]["id"]
        # At least four waves of requests at each concurrency: one wave's ragged end would decide a ratio.
        count = max(options.num_requests, 4 * max(options.concurrencies))
        asked = _questions(count, 0)
        answers = _answers(off_url, model, asked, options.max_tokens)
        again = [
            [{"role": "user", "content": q}, {"role": "assistant", "content": a}, {"role": "user", "content": q}]
            for q, a in zip(asked, answers, strict=True)
        ]
        fresh = [[{"role": "user", "content": q}] for q in _questions(count, count)]
        plain = [_body(model, m, options.max_tokens) for m in again]
        # (workload, (url, bodies) without drafts, (url, bodies) with them)
        cases = [
            ("repeat", (off_url, plain), (on_url, plain)),
            (
                "predict",
                (off_url, plain),
                (off_url, [_body(model, m, options.max_tokens, a) for m, a in zip(again, answers, strict=True)]),
            ),
            ("chat", (off_url, [_body(model, m, options.max_tokens) for m in fresh]), (on_url, None)),
        ]
        if options.draft_pair is not None:
            cases = [case for case in cases if case[0] != "predict"]
        rows: list[dict[str, Any]] = []
        for workload, off, on in cases:
            on = (on[0], on[1] if on[1] is not None else off[1])
            for concurrency in options.concurrencies:
                figures: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
                acceptance: list[tuple[float, float]] = []
                for round_index in range(options.rounds):
                    order = [("off", off), ("on", on)] if round_index % 2 == 0 else [("on", on), ("off", off)]
                    for name, (url, bodies) in order:
                        before = _drafting(url)
                        load = bodies[: max(options.num_requests, 4 * concurrency)]
                        samples, duration = asyncio.run(_closed_loop(url, load, concurrency, options.timeout))
                        after = _drafting(url)
                        summary = summarize(samples, duration)
                        if summary["errors"]:
                            first = next(s.error for s in samples if s.error)
                            raise RuntimeError(
                                f"{workload} c={concurrency} {name}: {summary['errors']} errors: {first}"
                            )
                        figures[name].append(summary)
                        if name == "on":
                            acceptance.append((after[0] - before[0], after[1] - before[1]))
                rows.append(_row(workload, concurrency, figures, acceptance))
    report_options = {**options.__dict__, "model": model_dir, "speculative_config": speculative_config}
    return {"stamp": stamp(), "options": {k: str(v) for k, v in report_options.items()}, "rows": rows}


def _row(
    workload: str, concurrency: int, figures: dict[str, list[dict[str, Any]]], acceptance: list[tuple[float, float]]
) -> dict[str, Any]:
    def median(name: str, key: str, inner: str | None = None) -> float:
        values = [s[key][inner] if inner else s[key] for s in figures[name]]
        return statistics.median(v for v in values if v is not None)

    accepted, drafted = sum(a for a, _ in acceptance), sum(d for _, d in acceptance)
    off, on = median("off", "output_throughput"), median("on", "output_throughput")
    ratios = [
        b["output_throughput"] / a["output_throughput"] for a, b in zip(figures["off"], figures["on"], strict=True)
    ]
    return {
        "workload": workload,
        "concurrency": concurrency,
        "tokens_per_s_off": off,
        "tokens_per_s_on": on,
        "speedup": statistics.median(ratios),
        "ttft_ms_off": median("off", "ttft_ms", "p50"),
        "ttft_ms_on": median("on", "ttft_ms", "p50"),
        "itl_ms_off": median("off", "itl_ms", "p50"),
        "itl_ms_on": median("on", "itl_ms", "p50"),
        "acceptance": accepted / drafted if drafted else None,
        "drafted_tokens": drafted,
        "rounds": len(ratios),
        "round_speedups": ratios,
    }


def format_spec(report: dict[str, Any]) -> str:
    header = ["workload", "C", "tok/s off", "tok/s on", "on/off", "TTFT p50 ms", "ITL p50 ms", "accepted"]
    rows = [
        [
            r["workload"],
            str(r["concurrency"]),
            fmt(r["tokens_per_s_off"]),
            fmt(r["tokens_per_s_on"]),
            f"{r['speedup']:.2f}x",
            f"{fmt(r['ttft_ms_off'])} / {fmt(r['ttft_ms_on'])}",
            f"{fmt(r['itl_ms_off'])} / {fmt(r['itl_ms_on'])}",
            "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}% of {r['drafted_tokens']:.0f}",
        ]
        for r in report["rows"]
    ]
    return f"{report['stamp']}\n" + format_table(header, rows)
