"""Structured outputs and tool calling end to end: a real `ferry serve` (tiny random-weight llama, hermes parser),
the clients people use (the OpenAI SDK, LangChain, litellm), every answer validated with jsonschema.

A random-weight model writes nonsense, so whatever validates does so because the grammar enforced it. Schemas
bound their strings, arrays and numbers so that every answer finishes well within max_tokens.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server_harness import ServerProcess, server_process, sse_payloads
from tests.test_json_closing import parses

# litellm fetches a model price list at import unless told to use its bundled copy; nothing may leave the machine.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"

MODEL = "tiny"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 200
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"offset_hours": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["offset_hours"],
        },
    },
}
TOOLS = [WEATHER, CLOCK]
# Nested objects, arrays, enums, numbers and optional fields.
TRIP = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "kind": {"type": "string", "enum": ["ferry", "train", "bus"]},
        "price": {"type": "number", "minimum": 0, "maximum": 100},
        "stops": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
        "operator": {
            "type": "object",
            "properties": {"code": {"type": "string", "maxLength": 4}, "rating": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 5}},
            "required": ["code"],
        },
        "night": {"type": "boolean"},
    },
    "required": ["name", "kind", "stops", "operator"],
}  # fmt: skip


@pytest.fixture(scope="module")
def server(model_dir: Callable[[str], Path]) -> Iterator[ServerProcess]:
    with server_process(
        model_dir("llama"), "--served-model-name", MODEL, "--tool-call-parser", "hermes", "--log-level", "warning"
    ) as running:
        yield running


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def chat(http: httpx.Client, **body: Any) -> dict[str, Any]:
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": MAX_TOKENS,
                                                       **body})  # fmt: skip
    assert response.status_code == 200, response.text
    return response.json()


def streamed_calls(
    http: httpx.Client, **body: Any
) -> tuple[dict[int, list[dict[str, Any]]], dict[int, str], list[Any]]:
    """Per choice, the calls a stream's tool_calls deltas assemble to (checking OpenAI's order) and the finish
    reason; and the chunks."""
    response = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": USER, "max_tokens": MAX_TOKENS, "stream": True, **body},
    )
    assert response.status_code == 200, response.text
    chunks = sse_payloads(response.content)
    calls: dict[int, list[dict[str, Any]]] = {}
    finish: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["finish_reason"]:
                finish[choice["index"]] = choice["finish_reason"]
            mine = calls.setdefault(choice["index"], [])
            for delta in choice["delta"].get("tool_calls", []):
                if "id" in delta:
                    assert delta["index"] == len(mine) and delta["type"] == "function"
                    assert delta["function"]["name"] and delta["function"]["arguments"] == ""
                    mine.append({"name": delta["function"]["name"], "arguments": ""})
                else:
                    assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
                    mine[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return calls, finish, chunks


def arguments_schema(name: str) -> dict[str, Any]:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def check_calls(message: dict[str, Any], complete: bool = True) -> list[dict[str, Any]]:
    """The message's calls as {name, arguments}, after checking their shape and their arguments' schema (all but
    the last when the answer was cut short: `complete` False)."""
    calls = []
    for call in message["tool_calls"]:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"]) and call["type"] == "function"
        calls.append({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})
    for call in calls if complete else calls[:-1]:
        jsonschema.validate(json.loads(call["arguments"]), arguments_schema(call["name"]))
    return calls


# ------------------------------------------------------------------------------------------- structured output


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_answers_validate(http: httpx.Client, seed: int) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP, "strict": True}}
    reply = chat(http, response_format=response_format, temperature=1.0, seed=seed, n=2)
    for choice in reply["choices"]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), TRIP)


def test_json_object_and_vllm_extras(http: httpx.Client) -> None:
    # Any object: nothing bounds its strings, so a random model's answer may run to the token limit, where the
    # budget closes it (and says `length`).
    reply = chat(http, response_format={"type": "json_object"}, n=8, temperature=1.0, seed=0)
    assert all(isinstance(json.loads(c["message"]["content"]), dict) for c in reply["choices"])
    assert {c["finish_reason"] for c in reply["choices"]} <= {"stop", "length"}
    assert chat(http, structured_outputs={"choice": ["ferry", "train"]})["choices"][0]["message"]["content"] in (
        "ferry", "train",
    )  # fmt: skip
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", chat(http, guided_regex=r"[0-9]{3}-[a-z]{2}")["choices"][0]["message"]
                        ["content"])  # fmt: skip
    assert chat(http, guided_choice=["yes", "no"])["choices"][0]["message"]["content"] in ("yes", "no")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"]}  # fmt: skip
    jsonschema.validate(json.loads(chat(http, guided_json=schema)["choices"][0]["message"]["content"]), schema)
    grammar = 'start: "ferry " NUMBER\nNUMBER: /[0-9]{1,3}/'
    assert re.fullmatch(r"ferry [0-9]{1,3}", chat(http, structured_outputs={"grammar": grammar})["choices"][0]
                        ["message"]["content"])  # fmt: skip
    completion = http.post("/v1/completions", json={"model": MODEL, "prompt": "Ferry", "max_tokens": 20,
                                                    "guided_regex": "(yes|no)"})  # fmt: skip
    assert completion.status_code == 200 and completion.json()["choices"][0]["text"] in ("yes", "no")


def test_json_closes_within_max_tokens_unless_turned_off(sdk: openai.OpenAI) -> None:
    """With a small limit the SDK's JSON mode still gets objects that parse (`length`: the budget closed them),
    a required tool call arguments that validate; `close_within_budget: false` leaves them cut off."""
    closed = sdk.chat.completions.create(
        model=MODEL, messages=USER, response_format={"type": "json_object"}, max_tokens=9, n=6, temperature=1.0,
        seed=3,
    )  # fmt: skip
    assert all(isinstance(json.loads(c.message.content), dict) for c in closed.choices)
    assert any(c.finish_reason == "length" for c in closed.choices)
    calls = sdk.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=70, n=4, temperature=1.0, seed=1
    )
    for choice in calls.choices:
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), arguments_schema(call.function.name))
    cut = sdk.chat.completions.create(
        model=MODEL, messages=USER, response_format={"type": "json_object"}, max_tokens=9, n=6, temperature=1.0,
        seed=3, extra_body={"close_within_budget": False},
    )  # fmt: skip
    assert any(not parses(c.message.content) for c in cut.choices)


def test_streamed_calls_carry_logprobs_usage_and_come_in_order(http: httpx.Client) -> None:
    """`logprobs` on streamed tool calls, `continuous_usage_stats`, several parallel calls in index order, and
    `n > 1` with tools: each choice its own calls."""
    body = {"tools": TOOLS, "tool_choice": "required", "logprobs": True, "n": 2, "temperature": 1.0, "seed": 4,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    calls, finish, chunks = streamed_calls(http, **body)
    assert set(calls) == {0, 1} and all(calls[i] for i in calls) and set(finish.values()) <= {"tool_calls", "length"}
    for choice_calls in calls.values():
        for call in choice_calls:
            jsonschema.validate(json.loads(call["arguments"]), arguments_schema(call["name"]))
    with_calls = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("tool_calls")]
    assert any(c["choices"][0]["logprobs"] for c in with_calls), "the tokens that wrote the calls"
    counted = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert all(isinstance(n, int) for n in counted) and counted == sorted(counted), "usage so far, in every chunk"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == counted[-1]


def test_min_tokens_and_stop_token_ids_reach_every_endpoint(http: httpx.Client) -> None:
    for path, body in (
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 6}),
        ("/v1/completions", {"prompt": "Ferry", "max_tokens": 6}),
        ("/v1/responses", {"input": "Ferry", "max_output_tokens": 6}),
    ):
        reply = http.post(path, json={"model": MODEL, "min_tokens": 6, "stop_token_ids": [1], **body})
        assert reply.status_code == 200, (path, reply.text)
        usage = reply.json()["usage"]
        assert usage.get("completion_tokens", usage.get("output_tokens")) == 6, path
        too_many = http.post(path, json={"model": MODEL, **body, "min_tokens": 7})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "min_tokens", path


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "u", "schema": {
            "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "u", "schema": {"type": "objeto"}}}},
         "response_format.json_schema.schema"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_tides"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                  "required": 5}}}]},
         "tools[0].function.parameters"),
    ],
)  # fmt: skip
def test_what_cannot_be_enforced_is_a_400_naming_the_field(http: httpx.Client, body: dict, param: str) -> None:
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"], error


def test_sdk_parse_returns_the_pydantic_object(sdk: openai.OpenAI) -> None:
    class Operator(BaseModel):
        code: str = Field(max_length=4)

    class Trip(BaseModel):
        name: str = Field(max_length=10)
        kind: Literal["ferry", "train"]
        seats: int = Field(ge=1, le=99)
        operator: Operator
        stops: list[Annotated[str, Field(max_length=8)]] = Field(max_length=2)

    completion = sdk.chat.completions.parse(model=MODEL, messages=USER, response_format=Trip, max_tokens=MAX_TOKENS)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Trip) and isinstance(parsed.operator, Operator)


# ------------------------------------------------------------------------------------------------------ tools


def test_required_gives_one_valid_call_and_the_stream_assembles_to_it(http: httpx.Client) -> None:
    body = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0}
    choice = chat(http, **body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = check_calls(choice["message"])
    assert len(calls) == 1
    streamed, finish, _ = streamed_calls(http, **body)
    assert streamed == {0: calls} and finish == {0: "tool_calls"}


def test_required_parallel_calls_validate(http: httpx.Client) -> None:
    """Nothing bounds how many calls a random model chains, so some answers reach the token limit mid-call (as
    OpenAI's, they keep that call as far as it got); every call before it validates."""
    body = {"tools": TOOLS, "tool_choice": "required", "n": 4, "temperature": 1.0, "seed": 0}
    choices = chat(http, **body)["choices"]
    calls = {c["index"]: check_calls(c["message"], complete=c["finish_reason"] == "tool_calls") for c in choices}
    finished = [c for c in choices if c["finish_reason"] == "tool_calls"]
    assert finished and any(len(calls[c["index"]]) > 1 for c in finished), "several calls in one answer"
    assert all(c["finish_reason"] in ("tool_calls", "length") for c in choices)
    streamed, finish, _ = streamed_calls(http, **body)
    assert streamed == calls and finish == {c["index"]: c["finish_reason"] for c in choices}


def test_named_choice_calls_that_function(http: httpx.Client, sdk: openai.OpenAI) -> None:
    body = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}, "temperature": 0}
    choice = chat(http, **body)["choices"][0]
    calls = check_calls(choice["message"])
    assert [c["name"] for c in calls] == ["get_time"] and choice["finish_reason"] == "tool_calls"
    assert streamed_calls(http, **body)[0] == {0: calls}
    reply = sdk.chat.completions.create(model=MODEL, messages=USER, max_tokens=MAX_TOKENS, **body)  # type: ignore[arg-type]
    (call,) = reply.choices[0].message.tool_calls or []
    assert call.function.name == "get_time" and call.function.arguments == calls[0]["arguments"]


def test_auto_reads_the_models_own_format(http: httpx.Client) -> None:
    """A scripted answer: a regex constraint makes the model write a Hermes call after some text."""
    script = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}' \
             "\n</tool_call>"  # fmt: skip
    body = {"tools": TOOLS, "guided_regex": re.escape(script)}
    choice = chat(http, **body)["choices"][0]
    assert choice["message"]["content"] == "Let me check.\n" and choice["finish_reason"] == "tool_calls"
    calls = check_calls(choice["message"])
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"})
    ]
    streamed, finish, chunks = streamed_calls(http, **body)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == {0: calls} and finish == {0: "tool_calls"} and content == "Let me check.\n"
    plain = chat(http, tools=TOOLS, guided_regex="No call needed")["choices"][0]
    assert plain["message"]["content"] == "No call needed" and "tool_calls" not in plain["message"]
    assert plain["finish_reason"] == "stop"


def test_a_tool_result_conversation_renders_and_answers(http: httpx.Client) -> None:
    first = chat(http, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0)
    message = first["choices"][0]["message"]
    conversation = [*USER, message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                                     "content": '{"temperature": 21}'}]  # fmt: skip
    answer = chat(http, messages=conversation, tools=TOOLS, max_tokens=8)["choices"][0]
    assert answer["finish_reason"] in ("stop", "length", "tool_calls")
    assert answer["message"]["content"] or answer["message"].get("tool_calls")
    # A client replaying a call that its token limit cut off: its arguments are text, not an object.
    cut = {
        **message,
        "tool_calls": [{**message["tool_calls"][0], "function": {"name": "get_weather", "arguments": '{"city": "Par'}}],
    }
    replay = chat(http, messages=[*USER, cut, conversation[-1]], tools=TOOLS, max_tokens=8)
    assert replay["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


# ---------------------------------------------------------------------------------------------------- clients


def test_langchain_bind_tools_and_structured_output(server: ServerProcess) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{server.base_url}/v1", api_key="none", model=MODEL, max_tokens=MAX_TOKENS,
                     temperature=0, max_retries=0)  # fmt: skip
    reply = llm.bind_tools(TOOLS, tool_choice="required", parallel_tool_calls=False).invoke("Weather in Paris?")
    assert reply.tool_calls, reply
    for call in reply.tool_calls:
        jsonschema.validate(call["args"], arguments_schema(call["name"]))
    named = llm.bind_tools(TOOLS, tool_choice="get_weather").invoke("Weather?")
    assert [call["name"] for call in named.tool_calls] == ["get_weather"]

    class Ferry(BaseModel):
        """A ferry line."""

        name: str = Field(max_length=10)
        crossings: int = Field(ge=0, le=50)
        kind: Literal["car", "foot"]

    for method in ("function_calling", "json_schema"):
        result = llm.with_structured_output(Ferry, method=method).invoke("Describe a ferry.")
        assert isinstance(result, Ferry), method
    schema = {"title": "Ferry", "description": "A ferry line.", "type": "object",
              "properties": {"name": {"type": "string"}}}  # fmt: skip
    result = llm.with_structured_output(schema, method="json_mode").invoke("Describe a ferry as JSON.")
    assert isinstance(result, dict)


def test_litellm_with_tools(server: ServerProcess) -> None:
    import litellm

    response = litellm.completion(
        model=f"openai/{MODEL}", api_base=f"{server.base_url}/v1", api_key="none", messages=USER, tools=TOOLS,
        tool_choice="required", parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=0,
    )  # fmt: skip
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls" and message.tool_calls
    for call in message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), arguments_schema(call.function.name))


def test_openapi_describes_every_tool_and_format_field(http: httpx.Client) -> None:
    schema = http.get("/openapi.json").json()
    components = schema["components"]["schemas"]
    request = components["ChatCompletionRequest"]["properties"]
    assert {"tools", "tool_choice", "parallel_tool_calls", "response_format", "structured_outputs", "guided_json",
            "guided_regex", "guided_choice", "guided_grammar"} <= set(request)  # fmt: skip
    assert {"guided_json", "structured_outputs"} <= set(components["CompletionRequest"]["properties"])
    formats = {ref["$ref"].rsplit("/", 1)[1] for ref in request["response_format"]["anyOf"][0]["oneOf"]}
    assert formats == {"ResponseFormatText", "ResponseFormatJSONObject", "ResponseFormatJSONSchema"}
    assert set(components["JSONSchemaFormat"]["properties"]) == {"name", "description", "schema", "strict"}
    assert set(components["StructuredOutputsParams"]["properties"]) == {"json", "regex", "choice", "grammar",
                                                                        "json_object"}  # fmt: skip
    assert "tool_calls" in components["ChatChoice"]["properties"]["finish_reason"]["enum"]
    assert components["ChatResponseMessage"]["properties"]["tool_calls"]["anyOf"][0]["items"]["$ref"].endswith(
        "/ToolCall"
    )
    assert set(components["ToolCallChunk"]["properties"]) == {"index", "id", "type", "function"}
    stream = schema["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    assert stream["schema"]["$ref"].endswith("/ChatCompletionChunk")
    assert "tool_calls" in components["ChatDelta"]["properties"]
