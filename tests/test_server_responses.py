"""End to end: the Responses API (`POST /v1/responses`) through the official OpenAI SDK, against a real `ferry serve`
of the scripted chat model (tests/scripted_chat.py): text, reasoning, function calls and their results, structured
text, the token limit, stream events, and the refusals of what the server cannot honour (stored state:
test_server_stored_responses.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.scripted_chat import (
    AFTER_TOOL_ANSWER,
    ANSWER,
    CALL,
    CALL_ARGUMENTS,
    CALL_NAME,
    EFFORT_ANSWER,
    LONG,
    PLAIN,
    PLAIN_PIECES,
    REASON,
    REASONING,
    THINK_AND_CALL,
    THINK_AND_CALL_REASONING,
    TOOL_RESULT,
)
from tests.server_harness import ServerProcess, server_process

MODEL = "scripted"
WEATHER = {
    "type": "function",
    "name": CALL_NAME,
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
PARIS_ONLY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris"]}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(scripted_chat_model: Path) -> Iterator[ServerProcess]:
    with server_process(
        scripted_chat_model, "--served-model-name", MODEL, "--num-pages", "256", "--log-level", "warning"
    ) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as http_client:
        yield http_client


def comparable(response: dict[str, Any]) -> dict[str, Any]:
    """A response without what differs between two runs of the same request (ids, times)."""
    response = {k: v for k, v in response.items() if k not in ("id", "created_at", "completed_at")}
    response["output"] = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response["output"]]
    return response


def test_text_and_reasoning(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input=f"Ferries? {REASON}", temperature=0)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.status == "completed" and response.incomplete_details is None and response.error is None
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert [part.text for part in reasoning.content or []] == [REASONING]
    assert message.type == "message" and message.id.startswith("msg_") and message.status == "completed"
    assert response.output_text == ANSWER
    usage = response.usage
    assert usage is not None and usage.output_tokens == 6, "the script's five tokens and EOS"
    assert usage.output_tokens_details.reasoning_tokens == 3, "<think>, the reasoning, </think>"
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_the_prompt_is_the_chat_prompt(client: openai.OpenAI) -> None:
    """`instructions` is a system message and `input` the user's, rendered by the same template as chat's."""
    response = client.responses.create(model=MODEL, instructions="Be brief.", input=PLAIN, temperature=0)
    chat = client.chat.completions.create(
        model=MODEL, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": PLAIN}],
    )  # fmt: skip
    assert response.output_text == chat.choices[0].message.content == "".join(PLAIN_PIECES)
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.instructions == "Be brief."


def test_stream_events_assemble_into_the_whole_response(client: openai.OpenAI, http: httpx.Client) -> None:
    request = {"model": MODEL, "input": f"Ferries? {REASON}", "temperature": 0}
    events = list(client.responses.create(**request, stream=True))
    kinds = [event.type for event in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING
    created, completed = events[0], events[-1]
    assert created.response.status == "in_progress" and created.response.output == []
    assert completed.response.id == created.response.id
    whole = http.post("/v1/responses", json=request).json()
    assert comparable(completed.response.model_dump(mode="json", exclude_unset=True)) == comparable(whole)


def test_stream_helper_of_the_sdk(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input=f"Ferries? {REASON}", temperature=0) as stream:
        text = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == ANSWER


def test_raw_stream_framing(http: httpx.Client) -> None:
    response = http.post("/v1/responses", json={"model": MODEL, "input": PLAIN, "temperature": 0, "stream": True})
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    frames = response.content.split(b"\n\n")
    assert frames[-1] == b"" and b"[DONE]" not in response.content, "a Responses stream ends with its last event"
    for frame in frames[:-1]:
        name, data = frame.split(b"\n")
        assert name.startswith(b"event: ") and data.startswith(b"data: ")
        assert json.loads(data.removeprefix(b"data: "))["type"] == name.removeprefix(b"event: ").decode()


def test_max_output_tokens_makes_the_response_incomplete(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input=LONG, temperature=0, max_output_tokens=2)
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens" and response.max_output_tokens == 2
    (reasoning,) = response.output
    assert reasoning.type == "reasoning" and reasoning.status == "incomplete"
    assert [part.text for part in reasoning.content or []] == ["Pondering more"]
    events = list(client.responses.create(model=MODEL, input=LONG, temperature=0, max_output_tokens=2, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"


def test_function_call_then_its_result(client: openai.OpenAI) -> None:
    question = [{"role": "user", "content": f"Weather in Paris? {CALL}"}]
    response = client.responses.create(model=MODEL, input=question, tools=[WEATHER], temperature=0)
    (call,) = response.output
    assert call.type == "function_call" and call.id is not None and call.id.startswith("fc_")
    assert call.call_id.startswith("call_") and call.name == CALL_NAME and call.status == "completed"
    assert json.loads(call.arguments) == CALL_ARGUMENTS
    assert response.output_text == "" and response.status == "completed"
    # The tool-result turn: the SDK sends the call back as it got it, then the result.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": f"Sunny. {TOOL_RESULT}"}
    follow_up = client.responses.create(
        model=MODEL, input=[*question, *response.output, result], tools=[WEATHER], temperature=0
    )
    assert follow_up.output_text == AFTER_TOOL_ANSWER


def test_function_call_streams_its_arguments(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input=CALL, tools=[WEATHER], temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert kinds[2:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    added, delta, done = events[2], events[3], events[4]
    assert added.item.type == "function_call" and added.item.name == CALL_NAME and added.item.arguments == ""
    assert json.loads(delta.delta) == CALL_ARGUMENTS and done.arguments == delta.delta
    with client.responses.stream(model=MODEL, input=CALL, tools=[WEATHER], temperature=0) as stream:
        (call,) = stream.get_final_response().output
    assert call.type == "function_call" and json.loads(call.arguments) == CALL_ARGUMENTS


def test_a_call_written_while_reasoning_is_reasoning_and_the_one_after_is_a_call(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input=THINK_AND_CALL, tools=[WEATHER], temperature=0)
    reasoning, call = response.output
    assert reasoning.type == "reasoning" and [p.text for p in reasoning.content or []] == [THINK_AND_CALL_REASONING]
    assert call.type == "function_call" and json.loads(call.arguments) == CALL_ARGUMENTS
    # Sent back, the reasoning item goes to the template as the assistant turn's reasoning_content.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}
    follow_up = client.responses.create(
        model=MODEL, input=[{"role": "user", "content": THINK_AND_CALL}, *response.output, result], temperature=0
    )
    assert follow_up.output_text == AFTER_TOOL_ANSWER


def test_langchain_on_the_responses_api(server: ServerProcess) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "Sunny."

    llm = ChatOpenAI(
        model=MODEL, base_url=f"{server.base_url}/v1", api_key="unused", use_responses_api=True, temperature=0,
        max_retries=0,
    )  # fmt: skip
    assert llm.invoke(f"Ferries? {REASON}").text == ANSWER
    assert "".join(chunk.text for chunk in llm.stream(f"Ferries? {REASON}")) == ANSWER
    with_tools = llm.bind_tools([get_weather])
    question = HumanMessage(f"Weather? {CALL}")
    asked = with_tools.invoke([question])
    (call,) = asked.tool_calls
    assert (call["name"], call["args"]) == (CALL_NAME, CALL_ARGUMENTS)
    answered = with_tools.invoke([question, asked, ToolMessage(f"Sunny. {TOOL_RESULT}", tool_call_id=call["id"])])
    assert answered.text == AFTER_TOOL_ANSWER


def test_named_tool_choice_is_enforced(client: openai.OpenAI) -> None:
    tool = {**WEATHER, "parameters": PARIS_ONLY}
    response = client.responses.create(
        model=MODEL, input="Anything.", tools=[tool], tool_choice={"type": "function", "name": CALL_NAME}
    )
    (call,) = response.output
    assert call.type == "function_call" and json.loads(call.arguments) == CALL_ARGUMENTS
    assert response.tool_choice.type == "function"


class City(BaseModel):
    city: Literal["Paris"]


def test_text_format_json_schema_through_the_sdk_parser(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(model=MODEL, input=PLAIN, text_format=City)
    assert parsed.output_parsed == City(city="Paris")
    assert parsed.text is not None and parsed.text.format is not None and parsed.text.format.type == "json_schema"


def test_reasoning_effort_reaches_the_template(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="x", temperature=0, reasoning={"effort": "high"})
    assert response.output_text == EFFORT_ANSWER and response.reasoning is not None
    assert response.reasoning.effort == "high"


@pytest.mark.parametrize(
    ("fields", "status", "param", "code"),
    [
        ({"previous_response_id": "resp_1"}, 404, "previous_response_id", "previous_response_not_found"),
        ({"conversation": "conv_1"}, 404, "conversation", "not_found"),
        ({"conversation": "conv_1", "previous_response_id": "resp_1"}, 400, "conversation",
         "mutually_exclusive_parameters"),
        ({"background": True, "store": False}, 400, "background", "invalid_value"),
        ({"include": ["reasoning.encrypted_content"]}, 400, "include", "unsupported_parameter"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type", "unsupported_parameter"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
         "input[0].content[0].image_url", "images_not_supported"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0].type", "unsupported_parameter"),
        ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, 400, "input[0].call_id",
         "invalid_value"),
        ({"input": []}, 400, "input", "invalid_value"),
        ({"reasoning": {"summary": "auto"}}, 400, "reasoning.summary", "unsupported_parameter"),
        ({"reasoning": {"effort": "low"}, "max_output_tokens": 0}, 400, "max_output_tokens", "invalid_value"),
        ({"tool_choice": "required"}, 400, "tool_choice", "invalid_value"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, 400,
         "text.format.schema", "invalid_json_schema"),
        ({"input": [{"role": "user", "content": 5}]}, 400, "input[0].content", "invalid_value"),
        ({"tools": [{**WEATHER, "parameters": {"type": "array"}}]}, 400, "tools[0].parameters", "invalid_value"),
        ({"frobnicate": 1}, 400, "frobnicate", "unknown_parameter"),
        ({"model": "gpt-4o"}, 404, "model", "model_not_found"),
        ({"input": " ferry" * 600}, 400, "input", "context_length_exceeded"),
    ],
)  # fmt: skip
def test_what_the_server_cannot_honour_is_refused_by_name(
    http: httpx.Client, fields: dict[str, Any], status: int, param: str, code: str
) -> None:
    response = http.post("/v1/responses", json={"model": MODEL, "input": PLAIN, **fields})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code)


def test_the_sdk_raises_the_refusal(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input=PLAIN, background=True, store=False)
    assert info.value.param == "background" and "needs 'store'" in info.value.message


def test_openapi_describes_the_endpoint(http: httpx.Client) -> None:
    schema = http.get("/openapi.json").json()
    operation = schema["paths"]["/v1/responses"]["post"]
    assert "text/event-stream" in operation["responses"]["200"]["content"]
    components = schema["components"]["schemas"]
    assert {"ResponsesRequest", "ResponseObject", "ReasoningItem", "FunctionCallOutput"} <= set(components)
    assert "max_output_tokens" in components["ResponsesRequest"]["properties"]
