"""End to end: reasoning split from the answer in /v1/chat/completions, template variables from the request, and
keep-alive pings, against a real `ferry serve` of the scripted chat model (tests/scripted_chat.py) and the
OpenAI SDK."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.scripted_chat import (
    ANSWER,
    EFFORT_ANSWER,
    LONG,
    NO_THINK_ANSWER,
    PLAIN,
    PLAIN_PIECES,
    REASON,
    REASONING,
)
from tests.server_harness import ServerProcess, server_process, sse_payloads

MODEL = "scripted"
PING_SECONDS = 0.05
# litellm fetches a model price list at import unless told to use its bundled copy; nothing may leave the machine.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def server(scripted_chat_model: Path) -> Iterator[ServerProcess]:
    with server_process(
        scripted_chat_model, "--served-model-name", MODEL, "--num-pages", "256", "--log-level", "warning",
        "--sse-ping-interval", str(PING_SECONDS),
    ) as running:  # fmt: skip
        yield running


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as http_client:
        yield http_client


def test_reasoning_is_split_from_the_answer(client: openai.OpenAI) -> None:
    """The server runs with the default `--reasoning-parser auto`: the template's `</think>` picked qwen3."""
    reply = client.chat.completions.create(model=MODEL, messages=user(f"Ferries? {REASON}"), temperature=0)
    message = reply.choices[0].message
    assert (message.content, message.reasoning_content) == (ANSWER, REASONING)
    assert reply.choices[0].finish_reason == "stop"


def test_a_reply_sent_back_brings_its_reasoning_to_the_template(client: openai.OpenAI) -> None:
    question = user(f"Ferries? {REASON}")
    reply = client.chat.completions.create(model=MODEL, messages=question, temperature=0).choices[0].message
    follow_up = [*question, reply, {"role": "user", "content": PLAIN}]  # the SDK sends reasoning_content back
    with_reasoning = client.chat.completions.create(model=MODEL, messages=follow_up, temperature=0)
    without = [*question, {"role": "assistant", "content": reply.content}, {"role": "user", "content": PLAIN}]
    plain = client.chat.completions.create(model=MODEL, messages=without, temperature=0)
    assert with_reasoning.choices[0].message.content == "".join(PLAIN_PIECES)
    assert with_reasoning.usage is not None and plain.usage is not None
    assert with_reasoning.usage.prompt_tokens > plain.usage.prompt_tokens, "the template rendered the reasoning"


def test_reasoning_streams_as_its_own_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=user(f"Ferries? {REASON}"), temperature=0, stream=True
    )
    # An SDK delta has the attribute only where the server sent the field (it is not in the SDK's chat types).
    deltas = [(getattr(c.choices[0].delta, "reasoning_content", None), c.choices[0].delta.content) for c in stream]
    reasoning = "".join(r or "" for r, _ in deltas)
    answer = "".join(c or "" for _, c in deltas)
    assert (reasoning, answer) == (REASONING, ANSWER)
    last_reasoning = max(i for i, (r, _) in enumerate(deltas) if r)
    assert all(not c for _, c in deltas[:last_reasoning]), "the answer starts once the reasoning ended"
    assert not any("think>" in (r or "") + (c or "") for r, c in deltas), "no tag reaches the client"


def test_litellm_reads_the_reasoning(server: ServerProcess) -> None:
    import litellm

    reply = litellm.completion(
        model=f"openai/{MODEL}", api_base=f"{server.base_url}/v1", api_key="unused", temperature=0,
        messages=user(f"Ferries? {REASON}"),
    )  # fmt: skip
    message = reply.choices[0].message
    assert (message.content, message.reasoning_content) == (ANSWER, REASONING)


def test_reasoning_stream_framing(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": user(REASON), "temperature": 0, "stream": True}
    chunks = sse_payloads(http.post("/v1/chat/completions", json=body).content)
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[-1] == {}
    assert {key for delta in deltas[1:-1] for key in delta} == {"reasoning_content", "content"}
    assert all(len(delta) == 1 for delta in deltas[1:-1]), "each delta carries one kind of text here"


def test_output_without_reasoning_is_all_answer(client: openai.OpenAI) -> None:
    message = client.chat.completions.create(model=MODEL, messages=user(PLAIN), temperature=0).choices[0].message
    assert message.content == "".join(PLAIN_PIECES)
    assert not hasattr(message, "reasoning_content"), "left out, as every field a message does not have"


def test_reasoning_cut_short_by_the_token_limit_is_all_reasoning(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=user(LONG), temperature=0, max_tokens=2)
    message = reply.choices[0].message
    assert (message.content, message.reasoning_content) == ("", "Pondering more")
    assert reply.choices[0].finish_reason == "length"


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(client: openai.OpenAI) -> None:
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    plain = client.chat.completions.create(model=MODEL, messages=user(REASON), temperature=0, extra_body=no_thinking)
    assert plain.choices[0].message.content == NO_THINK_ANSWER
    effort = client.chat.completions.create(model=MODEL, messages=user("x"), temperature=0, reasoning_effort="high")
    assert effort.choices[0].message.content == EFFORT_ANSWER


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"chat_template_kwargs": {"frobnicate": True}}, "chat_template_kwargs.frobnicate", "unsupported_parameter"),
        ({"chat_template_kwargs": {"reasoning_effort": "low"}, "reasoning_effort": "high"}, "reasoning_effort",
         "invalid_value"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort", "invalid_value"),
    ],
)  # fmt: skip
def test_template_variables_the_template_does_not_read_are_refused(
    http: httpx.Client, fields: dict[str, Any], param: str, code: str
) -> None:
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": user("x"), **fields})
    assert response.status_code == 400, response.text
    assert (response.json()["error"]["param"], response.json()["error"]["code"]) == (param, code)


def test_keep_alive_pings_are_comments_between_events(http: httpx.Client, client: openai.OpenAI) -> None:
    # After its script the model writes only EOS; ignore_eos keeps it going long enough for pings to come.
    body = {"model": MODEL, "messages": user(PLAIN), "temperature": 0, "max_tokens": 300, "ignore_eos": True}
    raw = http.post("/v1/chat/completions", json={**body, "stream": True}).content
    assert b"\n\n: ping\n\n" in raw
    chunks = sse_payloads(raw)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "".join(PLAIN_PIECES)
    stream = client.chat.completions.create(
        model=MODEL, messages=user(PLAIN), temperature=0, max_tokens=300, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == "".join(PLAIN_PIECES)
