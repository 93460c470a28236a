"""Unit tests of the OpenAI request schemas: validation, unsupported fields, mapping onto SamplingParams."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from pydantic import ValidationError

from server.openai.errors import APIError, validation_error
from server.openai.schemas import ChatCompletionRequest, CompletionRequest
from server.openai.tool_parsers.hermes import call_tags
from server.openai.tools import ForcedFunction, FunctionTool, resolve_tool_use

USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **fields})


def api_error(model: type, body: dict[str, Any]) -> APIError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    # FastAPI reports body errors with a leading "body" in the location.
    return validation_error([{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()])


def test_defaults_follow_openai() -> None:
    params = chat().sampling_params(max_new_tokens=5, choice_index=0, logprobs=False, top_logprobs=0)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (1.0, 1.0, 0, None)
    assert params.max_new_tokens == 5 and not params.ignore_eos


def test_fields_map_onto_sampling_params() -> None:
    request = chat(
        temperature=0, top_p=0.5, top_k=-1, min_p=0.1, seed=7, presence_penalty=1.5, frequency_penalty=-1,
        repetition_penalty=1.1, ignore_eos=True, min_tokens=2, stop_token_ids=[3, 4], max_tokens=9,
        max_completion_tokens=4, n=3,
    )  # fmt: skip
    params = request.sampling_params(max_new_tokens=4, choice_index=2, logprobs=True, top_logprobs=3)
    assert params.greedy and params.top_k == 0 and params.min_p == 0.1
    assert params.seed == 9, "choice i samples with seed + i"
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (1.5, -1, 1.1)
    assert params.ignore_eos and params.min_new_tokens == 2 and params.stop_token_ids == (3, 4)
    assert params.logprobs and params.top_logprobs == 3
    assert request.requested_max_tokens == 4, "max_completion_tokens wins over the deprecated max_tokens"


def test_what_langchain_and_the_sdk_send_is_accepted() -> None:
    request = chat(n=1, top_p=1.0, temperature=0.7, max_completion_tokens=5, stream=False, user="u", store=False,
                   metadata={"k": "v"}, tool_choice="none", tools=[], response_format={"type": "text"})  # fmt: skip
    request.check_supported()
    assert request.num_choices == 1


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_fields_that_cannot_be_honoured_are_refused_by_name(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        chat(**fields).check_supported()
    assert info.value.status_code == 400 and info.value.info.param == param


def test_logit_bias_keys_become_token_ids() -> None:
    params = chat(logit_bias={"1": 5, " 20": -100}).sampling_params(
        max_new_tokens=4, choice_index=0, logprobs=False, top_logprobs=0
    )
    assert params.logit_bias == ((1, 5.0), (20, -100.0))
    with pytest.raises(APIError) as info:
        chat(logit_bias={"hello": 1}).sampling_params(max_new_tokens=4, choice_index=0, logprobs=False, top_logprobs=0)
    assert info.value.info.param == "logit_bias"


@pytest.mark.parametrize(("fields", "param"), [({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of")])
def test_completion_fields_refused_by_name(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields}).check_supported()
    assert info.value.info.param == param


def test_messages_become_template_input() -> None:
    request = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "ok", "refusal": None, "tool_calls": None, "annotations": []},
        ]
    )
    assert request.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "ok"},
    ]


@pytest.mark.parametrize(
    ("message", "param"),
    [
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            "messages[0].content[0].type",
        ),
        ({"role": "function", "content": "x", "name": "f"}, "messages[0].role"),
        ({"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}, "messages[0].function_call"),
        ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
        ({"role": "tool", "content": "x", "tool_call_id": "call_1"}, "messages[0].tool_call_id"),
        (
            {
                "role": "user",
                "content": "x",
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            "messages[0].tool_calls",
        ),
    ],
)
def test_message_parts_that_cannot_be_honoured(message: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        chat(messages=[message]).template_messages()
    assert info.value.info.param == param


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"model": "m", "messages": USER, "max_tokens": "5"}, "max_tokens", "invalid_value"),
        ({"model": "m", "messages": USER, "max_tokens": -1}, "max_tokens", "invalid_value"),
        ({"model": "m", "messages": USER, "n": 0}, "n", "invalid_value"),
        ({"model": "m", "messages": USER, "top_p": 1.5}, "top_p", "invalid_value"),
        ({"model": "m", "messages": USER, "stop": 5}, "stop", "invalid_value"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_value"),
        ({"model": "m", "messages": USER, "frobnicate": 1}, "frobnicate", "unknown_parameter"),
        ({"model": "m"}, "messages", "missing_required_parameter"),
        ({"model": "m", "messages": []}, "messages", "invalid_value"),
    ],
)
def test_validation_errors_become_openai_400s(body: dict[str, Any], param: str, code: str) -> None:
    error = api_error(ChatCompletionRequest, body)
    assert (error.status_code, error.info.param, error.info.code) == (400, param, code)
    assert param in error.info.message


def test_completion_prompt_forms() -> None:
    for prompt in ("text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        assert CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompt == prompt
    assert api_error(CompletionRequest, {"model": "m", "prompt": [1, "a"]}).info.param == "prompt"


# A value each field of REFUSED_VALUES refuses, and where in a request it goes: what the OpenAPI document says is
# refused must be refused, and everything refused must be in the document.
REFUSED_EXAMPLES: dict[tuple[str, str], Any] = {
    ("ChatCompletionRequest", "functions"): [{"name": "f"}],
    ("ChatCompletionRequest", "function_call"): "auto",
    ("ChatCompletionRequest", "audio"): {"voice": "alloy", "format": "wav"},
    ("ChatCompletionRequest", "modalities"): ["text", "audio"],
    ("ChatCompletionRequest", "verbosity"): "low",
    ("ChatCompletionRequest", "web_search_options"): {},
    ("ChatMessage", "function_call"): {"name": "f", "arguments": "{}"},
    ("ChatMessage", "audio"): {"id": "a"},
    ("ContentPart", "type"): "image_url",
    ("ContentPart", "text"): None,
    ("StreamOptions", "include_obfuscation"): True,
    ("CompletionRequest", "suffix"): "x",
    ("CompletionRequest", "best_of"): 3,
}


def _request_with(schema: str, field: str, value: Any) -> tuple[type, dict[str, Any]]:
    message: dict[str, Any] = {"role": "user", "content": "hi"}
    if schema == "CompletionRequest":
        return CompletionRequest, {"model": "m", "prompt": "x", field: value}
    if schema == "ChatMessage":
        message[field] = value
    elif schema == "ContentPart":
        message["content"] = [{"type": "text", "text": "hi", field: value}]
    body: dict[str, Any] = {"model": "m", "messages": [message]}
    if schema == "StreamOptions":
        body.update(stream=True, stream_options={field: value})
    elif schema == "ChatCompletionRequest":
        body[field] = value
    return ChatCompletionRequest, body


def test_what_the_openapi_document_calls_refused_is_refused() -> None:
    from server.openapi import REFUSED_VALUES

    assert {(schema, field) for schema, fields in REFUSED_VALUES.items() for field in fields} == set(REFUSED_EXAMPLES)
    for (schema, field), value in REFUSED_EXAMPLES.items():
        model, body = _request_with(schema, field, value)
        request = model.model_validate(body)
        with pytest.raises(APIError) as info:
            request.check_supported()
            if isinstance(request, ChatCompletionRequest):
                request.template_messages()
        assert info.value.status_code == 400, (schema, field)
        # The field itself; or the part's type for a content part without text; or, for a message's legacy
        # function_call, the tool_calls it stands for.
        named = info.value.info.param
        assert named is not None and named.split(".")[-1].split("[")[0] in (field, "type", "tool_calls"), named


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_tool_use_becomes_template_input() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    request = chat(
        tools=[WEATHER_TOOL],
        messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
    )
    assert request.template_messages()[1:] == [
        {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {"name": "get_weather",
                                                                                "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"},
    ]  # fmt: skip
    tool_use = resolve_tool_use(request.function_tools(), request.tool_choice_value(), None, "hermes")
    assert tool_use is not None and tool_use.template_tools() == [WEATHER_TOOL]
    assert tool_use.constraint(None) is None, "auto is read by the parser, not enforced"


def constraint_of(**fields: Any) -> tuple[str, str, str] | None:
    found = chat(**fields).output_constraint()
    return None if found is None else (found.output.kind, found.output.spec, found.param)


def test_every_structured_output_surface_maps_to_one_constraint() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    json_schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    assert constraint_of(response_format=json_schema) == ("json_schema", spec, "response_format.json_schema.schema")
    assert constraint_of(response_format={"type": "json_object"}) == ("json_object", "", "response_format")
    assert constraint_of(response_format={"type": "text"}) is None
    assert constraint_of(structured_outputs={"json": schema}) == ("json_schema", spec, "structured_outputs.json")
    assert constraint_of(structured_outputs={"json": spec})[:2] == ("json_schema", spec)  # type: ignore[index]
    assert constraint_of(structured_outputs={"regex": "a+"}) == ("regex", "a+", "structured_outputs.regex")
    assert constraint_of(structured_outputs={"choice": ["x", "y"]}) == ("choice", '["x", "y"]',
                                                                        "structured_outputs.choice")  # fmt: skip
    assert constraint_of(structured_outputs={"grammar": 'root ::= "a"'})[:2] == ("grammar", 'root ::= "a"')  # type: ignore[index]
    assert constraint_of(structured_outputs={"json_object": True})[0] == "json_object"  # type: ignore[index]
    assert constraint_of(guided_json=schema) == ("json_schema", spec, "guided_json")
    assert constraint_of(guided_regex="[0-9]+") == ("regex", "[0-9]+", "guided_regex")
    assert constraint_of(guided_choice=["yes", "no"])[0] == "choice"  # type: ignore[index]
    assert constraint_of(guided_grammar='root ::= "a"')[0] == "grammar"  # type: ignore[index]
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "x", "guided_regex": "b"})
    assert completion.vllm_constraint() is not None


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objekt"}}}},
         "response_format.json_schema.schema", "invalid_json_schema"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "invalid_json_schema"),
        ({"guided_json": {"minimum": "zero"}}, "guided_json", "invalid_json_schema"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice",
         "conflicting_parameters"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "conflicting_parameters"),
        ({"structured_outputs": {}}, "structured_outputs", "invalid_value"),
        ({"guided_choice": []}, "guided_choice", "invalid_structured_output"),
    ],
)  # fmt: skip
def test_bad_structured_outputs_are_400s_naming_the_field(fields: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(APIError) as info:
        chat(**fields).output_constraint()
    assert (info.value.status_code, info.value.info.param, info.value.info.code) == (400, param, code)
    assert param in info.value.info.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
         "response_format.json_schema.name"),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"structured_outputs": {"json": {}, "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ],
)  # fmt: skip
def test_malformed_tool_and_format_fields_name_their_param(body: dict[str, Any], param: str) -> None:
    error = api_error(ChatCompletionRequest, {"model": "m", "messages": USER, **body})
    assert (error.status_code, error.info.param) == (400, param)


TOOLS = [
    FunctionTool("get_weather", None, WEATHER_TOOL["function"]["parameters"]),
    FunctionTool("get_time"),
]


@pytest.mark.parametrize(
    ("tools", "choice", "parser", "param", "code"),
    [
        ([], "required", "hermes", "tool_choice", "invalid_value"),
        (TOOLS, ForcedFunction("nope"), "hermes", "tool_choice", "invalid_value"),
        ([TOOLS[1], TOOLS[1]], "required", "hermes", "tools", "invalid_value"),
        ([FunctionTool("f", None, {"type": "object", "properties": 3})], "required", None,
         "tools[0].function.parameters", "invalid_json_schema"),
        ([FunctionTool("f", None, {"type": "string"})], "required", None, "tools[0].function.parameters",
         "invalid_value"),
        (TOOLS, "auto", None, "tool_choice", "unsupported_tool_choice"),
        (TOOLS, None, None, "tool_choice", "unsupported_tool_choice"),
    ],
)  # fmt: skip
def test_tool_use_that_cannot_be_served_is_refused(
    tools: list[FunctionTool], choice: Any, parser: str | None, param: str, code: str
) -> None:
    with pytest.raises(APIError) as info:
        resolve_tool_use(tools, choice, None, parser)
    assert (info.value.status_code, info.value.info.param, info.value.info.code) == (400, param, code)


def test_required_and_named_choices_constrain_to_valid_calls() -> None:
    def schema(choice: Any, parallel: bool | None = None) -> dict[str, Any]:
        tool_use = resolve_tool_use(TOOLS, choice, parallel, None)
        assert tool_use is not None
        constraint = tool_use.constraint(None)
        assert constraint is not None and constraint.output.kind == "json_schema"
        return json.loads(constraint.output.spec)

    def valid(value: Any, against: dict[str, Any]) -> bool:
        return jsonschema.Draft202012Validator(against).is_valid(value)

    required = schema("required")
    weather = {"name": "get_weather", "parameters": {"city": "Oslo"}}
    assert valid([weather], required) and valid([weather, {"name": "get_time", "parameters": {}}], required)
    assert not valid([], required), "at least one call"
    assert not valid([{"name": "get_weather", "parameters": {}}], required), "arguments validate"
    assert not valid([{"name": "other", "parameters": {}}], required), "only offered tools"
    assert not valid([{"name": "get_time", "parameters": {"x": 1}}], required), "a function without parameters"
    assert not valid([weather, weather], schema("required", parallel=False)), "parallel_tool_calls false: one call"
    named = schema(ForcedFunction("get_weather"))
    assert valid({"city": "Oslo"}, named) and not valid({}, named)
    assert resolve_tool_use(TOOLS, "none", None, None).template_tools() is None  # type: ignore[union-attr]
    assert resolve_tool_use([], "none", None, None) is None


HERMES_TAGS = ("<tool_call>\n", "\n</tool_call>")


def test_calls_in_the_models_own_format_where_the_grammar_knows_it() -> None:
    """With the model's call tags, enforced calls are written as the model writes them, and `auto` beside a
    JSON response_format is a call or the JSON answer (an agent with tools and a typed result)."""

    def spec(choice: Any, answer: Any = None, parallel: bool | None = None) -> dict[str, Any] | None:
        tool_use = resolve_tool_use(TOOLS, choice, parallel, "hermes", tags=HERMES_TAGS)
        assert tool_use is not None
        constraint = tool_use.constraint(answer)
        if constraint is None or constraint.output.kind != "tool_calls":
            return None
        return json.loads(constraint.output.spec)

    def valid(value: Any, against: dict[str, Any]) -> bool:
        return jsonschema.Draft202012Validator(against).is_valid(value)

    required = spec("required")
    assert required is not None and (required["begin"], required["end"]) == HERMES_TAGS
    assert required["parallel"] and required["answer"] is None
    assert valid({"name": "get_weather", "arguments": {"city": "Oslo"}}, required["call"])
    assert not valid({"name": "get_weather", "arguments": {}}, required["call"])
    assert not spec("required", parallel=False)["parallel"]  # type: ignore[index]
    named = spec(ForcedFunction("get_time"))
    assert named is not None and not named["parallel"]
    assert not valid({"name": "get_weather", "arguments": {"city": "Oslo"}}, named["call"])
    assert spec("auto") is None, "auto alone is read by the parser"
    typed = chat(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}})
    either = spec("auto", typed.output_constraint())
    assert either is not None and either["answer"] == {"type": "object"}
    regex = chat(guided_regex="[a-z]+").output_constraint()
    assert spec("auto", regex) is None, "only a JSON answer combines with calls"


PROBE = '{"name": "ferry_probe", "arguments": {"x": 1}}'


@pytest.mark.parametrize(
    ("written", "tags"),
    [
        (f"<tool_call>\n{PROBE}\n</tool_call>", HERMES_TAGS),
        (f"<tool_call>{PROBE}</tool_call>", ("<tool_call>", "</tool_call>")),
        ('<tool_call>{"arguments": {"x": 1}, "name": "ferry_probe"}</tool_call>', None),
        ("ferry_probe({'x': 1})", None),
    ],
)
def test_call_tags_are_read_from_the_template(written: str, tags: tuple[str, str] | None) -> None:
    """How the chat template writes one call: the grammar writes calls the same way, or in the array form."""
    assert call_tags(lambda call: f"<|user|>x<|assistant|>{written}<|eos|>") == tags
