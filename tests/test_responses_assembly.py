"""The Responses API's two conversions, without a server: input items -> template messages, and a choice's updates
-> output items and stream events."""

from __future__ import annotations

from typing import Any

import pytest

from server.openai.choices import ChoiceUpdate
from server.openai.errors import APIError
from server.openai.responses import ResponseAssembler
from server.openai.responses_input import template_messages
from server.openai.responses_schemas import (
    EchoedReasoning,
    EchoedTextConfig,
    InputTokensDetails,
    OutputTokensDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from server.openai.tool_parsers.base import ToolCallDelta

USAGE = ResponseUsage(
    input_tokens=3,
    input_tokens_details=InputTokensDetails(cached_tokens=0),
    output_tokens=2,
    output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
    total_tokens=5,
)


def messages(items: Any, instructions: str | None = None) -> list[dict[str, Any]]:
    return template_messages(instructions, ResponsesRequest.model_validate({"model": "m", "input": items}).input)


def test_a_tool_result_turn_renders_as_chat_messages() -> None:
    items = [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny."},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "Noon."}]},
    ]  # fmt: skip
    assert messages(items, instructions="Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Look.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "Sunny."},
        {"role": "tool", "tool_call_id": "call_2", "name": "get_time", "content": "Noon."},
    ]


def test_a_call_without_a_message_opens_its_own_assistant_turn() -> None:
    items = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
    ]
    assert messages(items)[-1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}],
    }


@pytest.mark.parametrize(
    ("items", "param"),
    [
        ([{"type": "reasoning", "summary": [], "encrypted_content": "x"}, {"role": "assistant", "content": "a"}],
         "input[0].encrypted_content"),
        ([{"type": "reasoning", "summary": []}, {"role": "user", "content": "a"}], "input[1]"),
        ([{"role": "user", "content": "a"}, {"type": "reasoning", "summary": []}], "input"),
        ([{"type": "item_reference", "id": "msg_1"}], "input[0].type"),
        ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "input[0].content[0].type"),
    ],
)  # fmt: skip
def test_what_cannot_be_rendered_is_refused_by_name(items: list[dict[str, Any]], param: str) -> None:
    with pytest.raises(APIError) as info:
        messages(items)
    assert info.value.status_code == 400 and info.value.info.param == param


def assembler() -> ResponseAssembler:
    return ResponseAssembler(
        ResponseObject(
            id="resp_1", created_at=0, status="in_progress", instructions=None, max_output_tokens=None, model="m",
            output=[], parallel_tool_calls=True, reasoning=EchoedReasoning(), temperature=1.0,
            text=EchoedTextConfig(format={"type": "text"}), tool_choice="auto", tools=[], top_p=1.0,
        )
    )  # fmt: skip


def update(text: str = "", reasoning: str = "", calls: list[ToolCallDelta] | None = None) -> ChoiceUpdate:
    return ChoiceUpdate(text, [], None, calls or [], reasoning)


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [event["type"] for event in events]


def test_whitespace_beside_calls_is_layout_and_otherwise_text() -> None:
    calling = assembler()
    events = calling.start()
    events += calling.feed(update(reasoning="Think."))
    events += calling.feed(update(text="\n"))
    events += calling.feed(update(calls=[ToolCallDelta(0, "call_1", "f", ""), ToolCallDelta(0, arguments="{}")]))
    events += calling.feed(update(text="  "))
    events += calling.finish("tool_calls", USAGE)
    assert [item.type for item in calling.response.output] == ["reasoning", "function_call"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["response"] == calling.response.model_dump(mode="json")
    talking = assembler()
    talking.feed(update(text="\n"))
    talking.feed(update(text="Hi"))
    talking.finish("stop", USAGE)
    (message,) = talking.response.output
    assert message.type == "message" and message.content[0].text == "\nHi"


def test_an_empty_answer_is_one_empty_message() -> None:
    empty = assembler()
    events = empty.finish("stop", USAGE)
    (message,) = empty.response.output
    assert message.type == "message" and message.content[0].text == "" and message.status == "completed"
    assert kinds(events) == [
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip


def test_the_token_limit_leaves_the_last_item_incomplete() -> None:
    cut = assembler()
    cut.feed(update(reasoning="Long"))
    cut.feed(update(text="Answ"))
    events = cut.finish("length", USAGE)
    reasoning, message = cut.response.output
    assert (reasoning.status, message.status) == ("completed", "incomplete")
    assert cut.response.status == "incomplete" and cut.response.incomplete_details is not None
    assert events[-1]["type"] == "response.incomplete"


def test_a_failure_ends_the_stream_with_an_error_then_response_failed() -> None:
    failing = assembler()
    failing.feed(update(text="Half"))
    error = APIError(504, "Too slow.", type="timeout_error", code="request_timeout")
    events = failing.fail(error)
    assert kinds(events)[-2:] == ["error", "response.failed"]
    assert {k: events[-2][k] for k in ("code", "message", "param")} == {
        "code": "request_timeout",
        "message": "Too slow.",
        "param": None,
    }
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "server_error", "message": "Too slow."}
    assert failed["output"][0]["status"] == "incomplete" and failed["output"][0]["content"][0]["text"] == "Half"
