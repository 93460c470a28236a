"""Issue 5's acceptance through the real server: `ferry serve` with no --model answers in words and stops; and
its quick start's tool call (issue 11): the demo template offers tools, a required call validates, and the
tool's result goes back through the template into an answer."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import pytest

from tests.server_harness import server_process
from tests.test_demo_model import MAX_NEW_TOKENS, MIN_STOPPED, PROMPTS

CITY = {"type": "string", "enum": ["Paris", "London", "Tokyo"]}
UNIT = {"type": "string", "enum": ["celsius", "fahrenheit"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": CITY, "unit": UNIT}, "required": ["city", "unit"]},
    },
}


def _mostly_words(text: str) -> bool:
    letters_and_spaces = sum(ch.isascii() and (ch.isalpha() or ch == " ") for ch in text)
    return len(text) > 0 and letters_and_spaces / len(text) >= 0.8


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with server_process(None) as server, httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def test_default_model_answers_in_words_and_stops(client: httpx.Client) -> None:
    model = client.get("/v1/models").json()["data"][0]["id"]
    stopped = 0
    for prompt in PROMPTS:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": MAX_NEW_TOKENS,
            "temperature": 0,
        }
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        text = choice["message"]["content"]
        text.encode("utf-8")
        assert _mostly_words(text), text
        stopped += choice["finish_reason"] == "stop"
    assert stopped >= MIN_STOPPED


def test_default_model_calls_a_tool_and_answers_its_result(client: httpx.Client) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    body = {"model": "default_model", "messages": ask, "tools": [WEATHER], "max_tokens": 64, "temperature": 0}
    # tool_choice auto works with the demo model: its template shows the Hermes format, so the parser is detected.
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    reply = client.post(
        "/v1/chat/completions", json={**body, "tool_choice": "required", "parallel_tool_calls": False}
    ).json()
    choice = reply["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    result = {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature_c": 21, "sky": "clear"}'}
    answer = client.post("/v1/chat/completions", json={**body, "messages": [*ask, choice["message"], result]})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"]
    assert answer.json()["usage"]["prompt_tokens"] > reply["usage"]["prompt_tokens"], "the call and result rendered"
