"""`ferry bench serve`: streaming load against an OpenAI-compatible server, with `vllm bench serve`'s metrics.

Two load shapes over the same seeded requests: closed loop (C clients, each sends its next request when the last
one finished) swept over concurrencies, and open loop (Poisson arrivals at a fixed rate, whatever the server's
progress). Prompts are token-id lists sent to /v1/completions with `ignore_eos`, so every request asks for exactly
its output length. The SSE stream is parsed by hand and every chunk is timestamped on arrival.

With `--response-format json_object|json_schema` the same requests carry a constraint (vLLM's `structured_outputs`,
which /v1/completions takes) instead of `ignore_eos`, which a constraint refuses: a schema that cannot be complete
within the output length (bench/schemas/trips.json asks for more trips than fit) keeps every request at exactly its
output length, so the constrained and the unconstrained figures count the same tokens.

Metric definitions, as vLLM's benchmark: TTFT is the time to the first chunk carrying a choice; ITL are the gaps
between successive such chunks; E2E latency ends at the last one; TPOT = (E2E - TTFT) / (output tokens - 1);
output tokens come from the final usage chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import httpx

from bench.checkpoints import resolve
from bench.llama_cpp import gguf_of, llama_server_command
from bench.report import fmt, format_table, stamp
from bench.workload import LengthDist, Workload, WorkloadSpec, make_workload

PERCENTILES = (50, 90, 99)


@dataclass
class RequestSample:
    index: int
    prompt_tokens: int
    start: float
    """Seconds from the start of the load point to sending the request."""
    output_tokens: int = 0
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    def on_token_chunk(self, now: float, sent: float, last: float) -> float:
        """A chunk carrying tokens arrived at `now`: the first sets TTFT, the others add a gap to ITL; returns
        `now`, the next gap's start."""
        if self.ttft is None:
            self.ttft = now - sent
        else:
            self.itl.append(now - last)
        return now


@dataclass
class ServeOptions:
    url: str | None = None
    model: str | None = None
    """Model to serve when no URL is given: the server is started on a free local port and stopped afterwards."""
    server: Literal["ferry", "vllm", "llama.cpp"] = "ferry"
    """Which server to start for `model`: `ferry serve`, `vllm serve` from `vllm_python`'s environment, or
    llama.cpp's `llama-server` from `llama_cpp` on a GGUF conversion of the model (bench/llama_cpp.py)."""
    vllm_python: Path | None = None
    """The python of an environment with vLLM installed (its `vllm` command sits beside it)."""
    llama_cpp: Path | None = None
    """The folder `../shared/peers/install-llama-cpp.sh` made (`bin/llama-server`, `convert`)."""
    server_args: tuple[str, ...] = ()
    quantization: str = "none"
    """The started server's weights: Ferry's --quantization, llama.cpp's counterpart (Q8_0 for int8, Q4_0 for
    int4: bench/llama_cpp.py)."""
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    vocab_size: int = 256
    """Prompt token ids are drawn below this; 256 fits every byte-level vocabulary."""
    concurrencies: tuple[int, ...] = (1, 8, 32, 64)
    rates: tuple[float, ...] = ()
    timeout: float = 600.0
    startup_timeout: float = 300.0
    structured_outputs: dict[str, object] | None = None
    """Sent as every request's `structured_outputs` (in place of `ignore_eos`); None: unconstrained."""


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _distribution(values: list[float]) -> dict[str, float | None]:
    """Milliseconds: mean and the percentiles."""
    ms = [v * 1000 for v in values]
    out: dict[str, float | None] = {"mean": sum(ms) / len(ms) if ms else None}
    out.update({f"p{q}": percentile(ms, q) for q in PERCENTILES})
    return out


def summarize(samples: list[RequestSample], duration: float) -> dict[str, object]:
    ok = [s for s in samples if s.error is None]
    output_tokens = sum(s.output_tokens for s in ok)
    tpots = [
        (s.latency - s.ttft) / (s.output_tokens - 1)
        for s in ok
        if s.output_tokens > 1 and s.latency is not None and s.ttft is not None
    ]
    return {
        "completed": len(ok),
        "errors": len(samples) - len(ok),
        "duration_seconds": duration,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_throughput": output_tokens / duration if duration > 0 else None,
        "total_token_throughput": (output_tokens + sum(s.prompt_tokens for s in ok)) / duration
        if duration > 0
        else None,
        "output_tokens": output_tokens,
        "ttft_ms": _distribution([s.ttft for s in ok if s.ttft is not None]),
        "tpot_ms": _distribution(tpots),
        "itl_ms": _distribution([gap for s in ok for gap in s.itl]),
        "e2el_ms": _distribution([s.latency for s in ok if s.latency is not None]),
    }


async def _send(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    workload: Workload,
    index: int,
    origin: float,
    structured_outputs: dict[str, object] | None = None,
) -> RequestSample:
    prompt = workload.prompts[index]
    sample = RequestSample(index, len(prompt), time.perf_counter() - origin)
    body: dict[str, object] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": workload.output_lens[index],
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if structured_outputs is None:
        body["ignore_eos"] = True
    else:
        body["structured_outputs"] = structured_outputs
    sent = time.perf_counter()
    last = sent
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:500]
                sample.error = f"HTTP {response.status_code}: {detail}"
                return sample
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, other SSE fields
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    break
                data = json.loads(payload)
                if data.get("error"):
                    sample.error = str(data["error"])
                    return sample
                now = time.perf_counter()
                if data.get("choices"):
                    last = sample.on_token_chunk(now, sent, last)
                if data.get("usage"):
                    sample.output_tokens = int(data["usage"].get("completion_tokens") or 0)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
        return sample
    if sample.ttft is None:
        sample.error = "the stream ended without a token"
    else:
        sample.latency = last - sent
    return sample


async def run_closed_loop(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    workload: Workload,
    concurrency: int,
    structured_outputs: dict[str, object] | None = None,
) -> tuple[list[RequestSample], float]:
    return await closed_loop(
        len(workload),
        concurrency,
        lambda index, origin: _send(client, url, model, workload, index, origin, structured_outputs),
    )


async def closed_loop(
    count: int, concurrency: int, send: Callable[[int, float], Awaitable[RequestSample]]
) -> tuple[list[RequestSample], float]:
    """Requests 0 .. count - 1 through `concurrency` users, each sending its next request (`send(index, origin)`,
    origin the loop's start) as soon as its last one ended: the samples by index, and the seconds it all took."""
    next_index = iter(range(count))
    samples: list[RequestSample] = []
    origin = time.perf_counter()

    async def user() -> None:
        for index in next_index:  # the shared iterator hands each request to exactly one user
            samples.append(await send(index, origin))

    await asyncio.gather(*(user() for _ in range(min(concurrency, count))))
    return sorted(samples, key=lambda s: s.index), time.perf_counter() - origin


async def run_open_loop(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    workload: Workload,
    rate: float,
    seed: int,
    structured_outputs: dict[str, object] | None = None,
) -> tuple[list[RequestSample], float]:
    rng = random.Random(seed)
    origin = time.perf_counter()
    tasks = []
    arrival = 0.0
    for index in range(len(workload)):
        delay = arrival - (time.perf_counter() - origin)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_send(client, url, model, workload, index, origin, structured_outputs)))
        arrival += rng.expovariate(rate) if rate != float("inf") else 0.0
    samples = await asyncio.gather(*tasks)
    return list(samples), time.perf_counter() - origin


async def _served_model(client: httpx.AsyncClient, url: str) -> str:
    response = await client.get(f"{url}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def _sweep(
    url: str, options: ServeOptions, transport: httpx.AsyncBaseTransport | None = None
) -> dict[str, object]:
    workload = make_workload(options.workload, options.vocab_size)
    widest = max([*options.concurrencies, 1])
    limits = httpx.Limits(max_connections=max(widest, len(workload)), max_keepalive_connections=widest)
    async with httpx.AsyncClient(timeout=options.timeout, limits=limits, transport=transport) as client:
        model = await _served_model(client, url)
        # One short request first: connection set-up and the server's first-request costs stay out of the figures.
        fixed = LengthDist("fixed", (8.0,))
        warm_spec = WorkloadSpec(1, fixed, fixed, 0, options.workload.seed + 1)
        warm = make_workload(warm_spec, options.vocab_size)
        # The constraint too: its grammar compiles once, outside the figures (the server caches it).
        constraint = options.structured_outputs
        await _send(client, url, model, warm.head(1), 0, time.perf_counter(), constraint)
        points = []
        for concurrency in options.concurrencies:
            samples, duration = await run_closed_loop(client, url, model, workload, concurrency, constraint)
            points.append(_point("concurrency", concurrency, samples, duration))
        for rate in options.rates:
            samples, duration = await run_open_loop(
                client, url, model, workload, rate, options.workload.seed, constraint
            )
            points.append(_point("request_rate", rate, samples, duration))
    return {"model": model, "points": points}


def _point(mode: str, load: float, samples: list[RequestSample], duration: float) -> dict[str, object]:
    return {"mode": mode, "load": load, **summarize(samples, duration), "samples": [asdict(s) for s in samples]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _server_command(options: ServeOptions, port: int) -> tuple[list[str], dict[str, str], str]:
    """The command line, environment and readiness path of the server to start."""
    assert options.model is not None
    model = resolve(options.model)
    if options.server == "llama.cpp":
        if options.llama_cpp is None:
            raise ValueError("--server llama.cpp needs --llama-cpp (the folder install-llama-cpp.sh made)")
        workload = make_workload(options.workload, options.vocab_size)
        command = llama_server_command(
            options.llama_cpp,
            gguf_of(options.llama_cpp, Path(model), options.quantization),
            port,
            slots=max([*options.concurrencies, 1]),
            context_per_slot=workload.max_seq_len + 16,  # the warm-up request is short; a little room to spare
            extra=options.server_args,
        )
        return command, dict(os.environ), "/health"
    if options.server == "vllm":
        if options.vllm_python is None:
            raise ValueError("--server vllm needs --vllm-python")
        if options.quantization != "none":
            raise ValueError("--quantization is for --server ferry and llama.cpp (vLLM quantizes checkpoints only)")
        command = [
            str(options.vllm_python.parent / "vllm"), "serve", model,
            "--host", "127.0.0.1", "--port", str(port), "--no-enable-log-requests", *options.server_args,
        ]  # fmt: skip
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        return command, {**env, "HF_HUB_OFFLINE": "1"}, "/health"
    command = [
        sys.executable, "-m", "ferry", "serve", "--model", model,
        # Quiet by default (one access-log line per request would bury the table); later flags override.
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--quantization", options.quantization,
        *options.server_args,
    ]  # fmt: skip
    return command, dict(os.environ), "/ready"


@contextlib.contextmanager
def _local_server(options: ServeOptions) -> Iterator[str]:
    """Start the chosen server for `options.model` on a free port; stop it on exit."""
    port = free_port()
    command, env, ready_path = _server_command(options, port)
    with started_server(command, env, f"http://127.0.0.1:{port}", ready_path, options.startup_timeout) as url:
        yield url


@contextlib.contextmanager
def started_server(
    command: list[str], env: dict[str, str], url: str, ready_path: str, timeout: float, log: Path | None = None
) -> Iterator[str]:
    """Run `command` (a server listening at `url`), wait until `ready_path` answers 200, yield `url`, and stop it
    on exit (terminate, then kill after 30 s). Its output goes to `log` when given (named in errors), else to
    this process's."""
    where = f": {log}" if log is not None else ""
    with contextlib.ExitStack() as stack:
        out = None
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            out = stack.enter_context(log.open("w"))
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT if out else None)
        try:
            deadline = time.monotonic() + timeout
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"the server exited with code {process.returncode} before it was ready{where}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}{ready_path}", timeout=2.0).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server was not ready after {timeout:.0f} s{where}")
                time.sleep(0.5)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def run_serve(options: ServeOptions, transport: httpx.AsyncBaseTransport | None = None) -> dict[str, object]:
    """`transport` replaces the network (tests pass an `httpx.MockTransport`)."""
    if (options.url is None) == (options.model is None):
        raise ValueError("give exactly one of a server URL or a model to serve")
    with contextlib.ExitStack() as stack:
        url = options.url.rstrip("/") if options.url else stack.enter_context(_local_server(options))
        result = asyncio.run(_sweep(url, options, transport))
    return {
        "benchmark": "serve",
        **stamp(),
        "url": options.url,
        "server": options.server if options.url is None else "given by URL",
        "workload": options.workload.describe(),
        "vocab_size": options.vocab_size,
        "structured_outputs": options.structured_outputs,
        **result,
    }


def format_serve(report: dict[str, object]) -> str:
    def triple(dist: dict[str, float | None]) -> str:
        return " / ".join(fmt(dist[f"p{q}"], 1) or "-" for q in PERCENTILES)

    headers = [
        "load",
        "done",
        "errors",
        "req/s",
        "out tok/s",
        "TTFT ms p50/90/99",
        "TPOT ms p50/90/99",
        "ITL ms p50/90/99",
    ]
    rows = []
    for point in report["points"]:
        label = f"c={point['load']}" if point["mode"] == "concurrency" else f"rate={point['load']:g}/s"
        rows.append(
            [
                label,
                str(point["completed"]),
                str(point["errors"]),
                fmt(point["request_throughput"]),
                fmt(point["output_throughput"], 1),
                triple(point["ttft_ms"]),
                triple(point["tpot_ms"]),
                triple(point["itl_ms"]),
            ]
        )
    workload = report["workload"]
    constraint = report.get("structured_outputs")
    title = (
        f"ferry bench serve: {report['model']}, {workload['num_requests']} requests per point, prompt "
        f"{workload['prompt_len']}, output {workload['output_len']} (streaming /v1/completions"
        + (f", constrained: {', '.join(constraint)}" if constraint else "")
        + ")"
    )
    return "\n".join([title, format_table(headers, rows)])
