"""`ferry serve --async-scheduling`: the engine process plans each step while the one before it runs, and the
server answers exactly as the synchronous engine does, streamed or not, stopped early or cut by the client."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_harness import metric, metric_samples, server_process
from tests.test_tensor_parallel import MODEL, PROMPTS, SERVE_SETUP, _complete_all, _expected_texts

pytestmark = pytest.mark.timeout(300)


async def _stream_and_stop(base_url: str, expected: str) -> tuple[str, str | None, str]:
    """A streamed completion with a stop string taken from the middle of the expected text."""
    stop = expected[len(expected) // 2 : len(expected) // 2 + 3]
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0) as client:
        stream = await client.completions.create(
            model=MODEL, prompt=PROMPTS[1], max_tokens=30, temperature=0, stream=True, stop=[stop]
        )
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
    return text, reason, stop


def test_async_scheduling_serves_what_the_synchronous_engine_computes(model_dir: Callable[[str], Path]) -> None:
    path = model_dir("llama")
    expected = _expected_texts(path)
    with server_process(path, *SERVE_SETUP, "--async-scheduling") as server:
        assert asyncio.run(_complete_all(server.base_url)) == expected
        text, reason, stop = asyncio.run(_stream_and_stop(server.base_url, expected[1]))
        assert reason == "stop" and text == expected[1][: expected[1].index(stop)]
        # A client that goes away mid-stream: its request is aborted in the engine, and the server goes on.
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 40, "stream": True, "ignore_eos": True}
            with http.stream("POST", "/v1/completions", json=body) as response:
                next(response.iter_lines())
            assert asyncio.run(_complete_all(server.base_url)) == expected
            samples = metric_samples(http)
            assert metric(samples, "ferry:num_requests_running") == 0
            assert metric(samples, "ferry:num_preemptions_total") > 0
        assert server.stop() == 0
