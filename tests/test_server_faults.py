"""End to end, when things go wrong: a full queue, a request timeout, the engine process killed, SIGTERM.

Each test runs its own `ferry serve` (they end or configure the server in ways no other test can share).
Long requests use n=4 with --max-num-seqs 1, so the engine runs their choices one after the other: nearly two
thousand steps however fast the machine, a window wide enough to act in while they are in flight.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_harness import (
    ServerProcess,
    engine_idle,
    metric,
    metric_samples,
    parse_metrics,
    server_process,
    sse_payloads,
    wait_until,
)

# A stuck server must fail its test, not hang the suite.
pytestmark = pytest.mark.timeout(180)

MODEL = "tiny"
LONG = {"model": MODEL, "prompt": "Ferry boats", "max_tokens": 480, "ignore_eos": True, "n": 4}


def serve(model_dir: Callable[[str], Path], *args: str) -> AbstractContextManager[ServerProcess]:
    return server_process(
        model_dir("llama"), "--served-model-name", MODEL, "--num-pages", "256", "--max-num-seqs", "1",
        "--log-level", "warning", *args,
    )  # fmt: skip


async def read_events(chunks: AsyncIterator[bytes], count: int) -> bytes:
    """Read a streaming body until it holds `count` complete SSE events; return what was read."""
    body = b""
    while body.count(b"\n\n") < count:
        body += await anext(chunks)
    return body


async def read_rest(chunks: AsyncIterator[bytes]) -> bytes:
    return b"".join([chunk async for chunk in chunks])


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    status = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return status in ("Z", "X")  # a zombie has exited; only its parent's wait is missing


def test_queue_overflow_gets_429_with_retry_after(model_dir: Callable[[str], Path]) -> None:
    with serve(model_dir, "--max-queue-size", "1") as server:
        short = {"model": MODEL, "prompt": "Ferry boats", "max_tokens": 8, "ignore_eos": True}

        async def run() -> tuple[httpx.Response, list[httpx.Response]]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
                # One long request holds the only running slot; then one request fits in the queue.
                long = asyncio.create_task(client.post("/v1/completions", json={**LONG, "n": 1}))
                while metric(parse_metrics((await client.get("/metrics")).text), "ferry:num_requests_running") < 1:
                    await asyncio.sleep(0.01)
                shorts = await asyncio.gather(*(client.post("/v1/completions", json=short) for _ in range(6)))
                return await long, shorts

        long, shorts = asyncio.run(run())
        rejected = [r for r in shorts if r.status_code == 429]
        served = [r for r in shorts if r.status_code == 200]
        assert len(rejected) >= 4 and len(rejected) + len(served) == 6
        for response in rejected:
            assert response.headers["Retry-After"] == "1"
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == "queue_full"
        assert long.status_code == 200 and all(r.json()["usage"]["completion_tokens"] == 8 for r in served)
        with httpx.Client(base_url=server.base_url) as http:
            assert metric(metric_samples(http), "ferry:request_rejected_total", reason="queue_full") == len(rejected)


def test_request_timeout_aborts_the_request(model_dir: Callable[[str], Path]) -> None:
    with serve(model_dir, "--request-timeout", "0.5") as server, httpx.Client(base_url=server.base_url) as http:
        response = http.post("/v1/completions", json=LONG, timeout=60)
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "request_timeout"
        streamed = http.post("/v1/completions", json={**LONG, "stream": True}, timeout=60)
        assert streamed.status_code == 200
        *chunks, error = sse_payloads(streamed.content)
        assert error["error"]["code"] == "request_timeout" and error["error"]["type"] == "timeout_error"
        assert all("choices" in chunk for chunk in chunks)
        wait_until(lambda: engine_idle(http), timeout=5)
        assert metric(metric_samples(http), "ferry:request_rejected_total", reason="timeout") == 2


def test_killed_engine_fails_requests_and_the_server_exits(model_dir: Callable[[str], Path]) -> None:
    with serve(model_dir, "--max-num-seqs", "4") as server:
        engine_pid = server.engine_pid()

        async def run() -> tuple[list[bytes], httpx.Response, float, httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
                whole = asyncio.create_task(client.post("/v1/completions", json=LONG))
                async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as stream:
                    assert stream.status_code == 200
                    chunks = stream.aiter_bytes()
                    first = await read_events(chunks, 3)
                    os.kill(engine_pid, signal.SIGKILL)
                    killed = time.monotonic()
                    # The server lingers a moment before exiting, so probes see the 503 first.
                    while (health := await client.get("/health")).status_code == 200:
                        await asyncio.sleep(0.01)
                    refused = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
                    body = first + await read_rest(chunks)
                return body.split(b"\n\n"), await whole, time.monotonic() - killed, health, refused

        frames, whole, elapsed, health, refused = asyncio.run(run())
        assert elapsed < 5, "in-flight requests must end promptly"
        assert frames[-2:] == [b"data: [DONE]", b""]
        error = json.loads(frames[-3].removeprefix(b"data: "))["error"]
        assert error["code"] == "engine_error" and error["type"] == "server_error"
        assert whole.status_code == 500 and whole.json()["error"]["code"] == "engine_error"
        assert health.status_code == 503
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
        assert server.process.wait(timeout=30) != 0


def test_engine_never_outlives_a_killed_server(model_dir: Callable[[str], Path]) -> None:
    with serve(model_dir) as server:
        engine_pid = server.engine_pid()
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json={**LONG, "stream": True}) as stream:
            next(stream.iter_bytes())  # mid-generation: the engine is busy, not waiting on its pipe
            server.process.kill()
            server.process.wait()
        wait_until(lambda: process_gone(engine_pid), timeout=10)


def test_sigterm_drains_in_flight_requests_then_exits_0(model_dir: Callable[[str], Path]) -> None:
    with serve(model_dir, "--drain-timeout", "60") as server:
        engine_pid = server.engine_pid()

        async def run() -> tuple[list[Any], httpx.Response, httpx.Response]:
            async with (
                httpx.AsyncClient(base_url=server.base_url, timeout=60) as client,
                client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as stream,
            ):
                chunks = stream.aiter_bytes()
                first = await read_events(chunks, 2)
                server.process.send_signal(signal.SIGTERM)
                while (ready := await client.get("/ready")).status_code == 200:
                    await asyncio.sleep(0.01)
                refused = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
                body = first + await read_rest(chunks)
            return sse_payloads(body), ready, refused

        chunks, ready, refused = asyncio.run(run())
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "draining"
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        finished = [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
        assert finished == ["length"] * 4, "the in-flight request ran to completion"
        assert server.process.wait(timeout=30) == 0
        wait_until(lambda: process_gone(engine_pid), timeout=10)


def test_drain_timeout_fails_what_is_left_and_exits_0(model_dir: Callable[[str], Path]) -> None:
    with serve(model_dir, "--drain-timeout", "0.5") as server:

        async def run() -> bytes:
            async with (
                httpx.AsyncClient(base_url=server.base_url, timeout=60) as client,
                client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as stream,
            ):
                chunks = stream.aiter_bytes()
                first = await read_events(chunks, 2)
                server.process.send_signal(signal.SIGTERM)
                return first + await read_rest(chunks)

        *_, error = sse_payloads(asyncio.run(run()))
        assert error["error"]["code"] == "shutting_down"
        assert server.process.wait(timeout=30) == 0


@pytest.mark.parametrize("attach_at_once", [False, True])
def test_an_engine_dead_before_the_front_end_attaches_says_why(tmp_path: Path, attach_at_once: bool) -> None:
    """`ferry serve` spawns its engine before the front end's imports: an engine that fails at start may be gone
    before the client reads its pipe, and its reason (EngineFailed) must still reach the death's message."""
    from engine.config import EngineConfig
    from server.client import EngineClient, EngineDeadError, EngineProcess

    config = EngineConfig.of(model=str(tmp_path))  # no config.json: the engine fails to load it
    engine = EngineProcess.spawn(config, log_level="critical", log_format="text", step_log=None)
    if not attach_at_once:
        engine.process.join(120)
        assert engine.process.exitcode == 1

    async def attach() -> str:
        client = EngineClient(config, engine=engine)
        client.start()
        if not attach_at_once:
            await asyncio.sleep(0.2)  # the sentinel fires before the reader starts, as while a tokenizer loads
        with pytest.raises(EngineDeadError) as died:
            await asyncio.wait_for(client.wait_ready(), 120)
        await client.shutdown()
        return str(died.value)

    message = asyncio.run(attach())
    assert "died (exit code 1)" in message and "not a model directory" in message, message
