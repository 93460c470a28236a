"""`ferry bench spec`: speculative decoding against none, side by side in one run, on three chat workloads.

Two Ferry servers of the same model run at once (one with --speculative-config, one without; each idles while the
other is measured), and every load point alternates between them for `rounds` rounds: the figures are medians
over rounds, so that this machine's drift does not decide a ratio. The workloads are built from the model's own
answers (greedy, from the server without drafts), so that what repeats is what this model says:

- `repeat`: the user asks a question, gets the model's answer, and asks the same question again, kept where the
  model's second answer repeats its first word for word: answers that repeat text of their prompt (as edits,
  extraction and summaries do). Questions are asked in order until enough such conversations are found (cycled
  where the whole pool holds fewer);
- `predict`: the same conversations with OpenAI's `prediction` set to the earlier answer (Predicted Outputs),
  against the same conversations without it, both on the server without --speculative-config;
- `ask-again`: every question asked again, whatever the model answers the second time (a small model often
  answers otherwise: what drafting gains on a workload that repeats only in part);
- `chat`: fresh questions, nothing to copy from.

Each point is a closed loop of C clients over the workload's requests (greedy, streamed chat completions): output
tokens/s, TTFT and ITL medians, and the drafted tokens' acceptance from the server's /metrics.

`--draft-pair` measures the draft-model path instead: the served model is the demo model widened and deepened by
layers that nudge what it says (`draft_pair_target`, about 10x the demo's cost per token), drafted for by the demo
model itself (`method: draft_model`), on the repeat, ask-again and chat workloads.
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


FUNCTIONS = (
    "os.getcwd", "os.listdir", "os.remove", "os.rename", "os.makedirs", "os.path.exists", "os.path.basename",
    "os.path.dirname", "os.path.splitext", "os.path.isdir", "math.sqrt", "math.floor", "math.ceil", "math.gcd",
    "math.log", "json.loads", "json.load", "json.dump", "re.compile", "re.match", "re.search", "re.sub", "re.split",
    "shutil.copy", "shutil.rmtree", "shutil.move", "time.sleep", "time.time", "random.choice", "random.shuffle",
    "random.randint", "itertools.chain", "itertools.product", "itertools.groupby", "functools.reduce",
    "functools.partial", "functools.lru_cache", "collections.namedtuple", "copy.deepcopy", "copy.copy", "glob.glob",
    "textwrap.dedent", "textwrap.wrap", "string.capwords", "base64.b64encode", "hashlib.sha256", "zlib.compress",
    "gzip.open", "csv.reader", "csv.writer", "pickle.dumps", "pickle.loads", "struct.pack", "struct.unpack",
    "heapq.heappush", "heapq.heappop", "bisect.bisect_left", "operator.itemgetter", "inspect.signature",
    "tempfile.mkdtemp", "urllib.parse.quote", "uuid.uuid4", "sys.exit",
)  # fmt: skip
FUNCTION_QUESTIONS = ("What does {} do?", "Explain {}.", "What is {} for?", "Tell me what {} does.")
"""Standard-library functions asked about as the demo model was taught to answer them (its answers come from their
docstrings; the same templates as scripts/train_demo_model.py's FUNCTION_QUESTIONS, a script bench/ does not
import): more questions for the `repeat` workload to find repeating answers among."""


WAVES = 8
"""Requests per load point, at least, in multiples of its concurrency: with fewer, one wave's ragged end, and at a
second or less a run, this machine's noise (5% a run at four clients, two servers of the same flags alternating)
would decide a ratio."""


@dataclass(frozen=True)
class SpecOptions:
    model: str
    speculative_config: str = '{"method": "ngram", "num_speculative_tokens": 8}'
    concurrencies: tuple[int, ...] = (1, 4, 32)
    rounds: int = 9
    num_requests: int = 64
    """Requests per load point, at least `WAVES` times its concurrency."""
    max_tokens: int = 128
    timeout: float = 600.0
    draft_pair: Path | None = None
    """Set: measure the draft-model pair built in this folder (module docstring) instead of `model`."""


PAIR_EXTRA_LAYERS = 16
PAIR_INTERMEDIATE_SIZE = 4096
"""The draft pair's served model: the demo model (4 layers, hidden size 256, MLP width 768) with every MLP widened
to this (the demo's layers padded with zeros, which leaves what they compute unchanged) and `PAIR_EXTRA_LAYERS`
layers added (67M parameters against the demo's 4M): a decode step 9.5-10.8x the demo's in process on a 2-core
Xeon (10.4-10.7 against 0.96-1.13 ms a token at batch 1)."""
PAIR_NOISE = 0.06
"""Standard deviation of the added layers' output projections (attention's o_proj, the MLP's down_proj; the other
weights have 0.02): the added layers nudge the residual stream, so the served model mostly says what the demo
model says and sometimes not, a draft of realistic acceptance: over 20 of the bench's questions, 40 greedy tokens
each, the demo model's argmax equals the served model's at 79% of positions (85% with 12 added layers, 63% with
12 layers at 0.1; 100% at 0, where the widened demo layers alone compute what the demo does)."""


def draft_pair_target(folder: Path) -> Path:
    """The draft pair's served model in `folder` (built once, seed 0): the demo model widened and deepened
    (`PAIR_INTERMEDIATE_SIZE`, `PAIR_EXTRA_LAYERS`), the added layers random with small output projections
    (`PAIR_NOISE`), with its tokenizer and chat template, so that the demo model drafts for it and is often, not
    always, right."""
    target = folder / "widened-demo"
    if (target / "model.safetensors").exists():
        return target
    demo = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32)
    config = AutoConfig.from_pretrained(DEMO_MODEL)
    config.num_hidden_layers = demo.config.num_hidden_layers + PAIR_EXTRA_LAYERS
    config.intermediate_size = PAIR_INTERMEDIATE_SIZE
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.02)
        for layer in model.model.layers[demo.config.num_hidden_layers :]:
            layer.self_attn.o_proj.weight.normal_(0.0, PAIR_NOISE)
            layer.mlp.down_proj.weight.normal_(0.0, PAIR_NOISE)
        params = dict(model.named_parameters())
        for name, weight in demo.state_dict().items():
            if name not in params:
                continue  # the tied head
            padded = torch.zeros_like(params[name])
            padded[tuple(slice(0, size) for size in weight.shape)] = weight
            params[name].copy_(padded)
    model.save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        (target / name).write_bytes((DEMO_MODEL / name).read_bytes())
    return target


def _repeat_pool() -> list[str]:
    """Every question the `repeat` and `ask-again` workloads draw from, in the order they are asked."""
    return [q.format(s) for q in QUESTIONS for s in SUBJECTS] + [
        q.format(f) for q in FUNCTION_QUESTIONS for f in FUNCTIONS
    ]


def _fresh_questions(count: int) -> list[str]:
    """`chat`'s questions: none of them in the repeat pool, which the server without drafts has answered (its
    prefix cache would hold them, and not the drafting server's)."""
    asked = set(_repeat_pool())
    texts = [text for q in QUESTIONS for f in FUNCTIONS if (text := q.format(f)) not in asked]
    return [texts[i % len(texts)] for i in range(count)]


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


def _answer(client: httpx.Client, url: str, model: str, messages: list[dict[str, str]], max_tokens: int) -> str:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    response = client.post(f"{url}/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"] or ""


@dataclass(frozen=True)
class Asked:
    """Questions asked once and again, from the server without drafts (greedy)."""

    again: list[list[dict[str, str]]]
    """The first `count` conversations, whatever was answered the second time (`ask-again`)."""
    repeating: list[list[dict[str, str]]]
    """Conversations whose second answer repeats the first word for word (`repeat`), as many as were needed (the
    first answer, the prediction, is each conversation's second message)."""
    asked: int
    """Questions asked to find them."""


def ask_again(url: str, model: str, pool: list[str], count: int, max_tokens: int) -> Asked:
    """Asks `pool`'s questions in order, each once and then again after its own answer, until `count` have been
    asked and `count` conversations found whose second answer repeats the first (or the pool runs out)."""
    again: list[list[dict[str, str]]] = []
    repeating: list[list[dict[str, str]]] = []
    asked = 0
    with httpx.Client(timeout=600) as client:
        for question in pool:
            if asked >= count and len(repeating) >= count:
                break
            asked += 1
            answer = _answer(client, url, model, [{"role": "user", "content": question}], max_tokens)
            conversation = [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
                {"role": "user", "content": question},
            ]
            if len(again) < count:
                again.append(conversation)
            if len(repeating) < count and _answer(client, url, model, conversation, max_tokens) == answer:
                repeating.append(conversation)
    return Asked(again, repeating, asked)


def _cycled(items: list[Any], count: int) -> list[Any]:
    return [items[i % len(items)] for i in range(count)] if items else []


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
        count = max(options.num_requests, WAVES * max(options.concurrencies))
        asked = ask_again(off_url, model, _repeat_pool(), count, options.max_tokens)
        repeating = _cycled(asked.repeating, count)
        fresh = [[{"role": "user", "content": q}] for q in _fresh_questions(count)]
        repeat_bodies = [_body(model, m, options.max_tokens) for m in repeating]
        again = [_body(model, m, options.max_tokens) for m in asked.again]
        # (workload, (url, bodies) without drafts, (url, bodies) with them)
        cases = [
            ("repeat", (off_url, repeat_bodies), (on_url, repeat_bodies)),
            (
                "predict",
                (off_url, repeat_bodies),
                (off_url, [_body(model, m, options.max_tokens, m[1]["content"]) for m in repeating]),
            ),
            ("ask-again", (off_url, again), (on_url, again)),
            ("chat", (off_url, [_body(model, m, options.max_tokens) for m in fresh]), (on_url, None)),
        ]
        # The server without drafts answered these conversations' prompts while they were found: the drafting
        # server reads them once too (each once: the repeating ones are cycled and among `again`), untimed, so that
        # neither starts a round with a prefix cache the other lacks.
        read = {m[0]["content"]: m for m in [*asked.again, *asked.repeating]}.values()
        asyncio.run(_closed_loop(on_url, [_body(model, m, options.max_tokens) for m in read], 4, options.timeout))
        if not asked.repeating:  # nothing this model says twice: no repeating workload to measure
            cases = [case for case in cases if case[0] not in ("repeat", "predict")]
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
                        load = bodies[: max(options.num_requests, WAVES * concurrency)]
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
    return {
        "stamp": stamp(),
        "options": {k: str(v) for k, v in report_options.items()},
        "repeating": {"found": len(asked.repeating), "asked": asked.asked},
        "rows": rows,
    }


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
    found = report["repeating"]
    pool = f"repeat and predict: {found['found']} repeating conversations found in {found['asked']} asked\n"
    return f"{report['stamp']}\n" + pool + format_table(header, rows)
