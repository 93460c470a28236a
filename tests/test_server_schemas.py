"""Unit tests of the OpenAI request schemas: validation, unsupported fields, mapping onto SamplingParams."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from server.app import validation_error
from server.openai.errors import APIError
from server.openai.schemas import ChatCompletionRequest, CompletionRequest

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
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
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
        ({"role": "tool", "content": "x", "tool_call_id": "t"}, "messages[0].role"),
        ({"role": "assistant", "tool_calls": [{"id": "t"}]}, "messages[0].tool_calls"),
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
    ("ChatCompletionRequest", "tools"): [{"type": "function", "function": {"name": "f"}}],
    ("ChatCompletionRequest", "tool_choice"): "auto",
    ("ChatCompletionRequest", "functions"): [{"name": "f"}],
    ("ChatCompletionRequest", "function_call"): "auto",
    ("ChatCompletionRequest", "response_format"): {"type": "json_object"},
    ("ChatCompletionRequest", "audio"): {"voice": "alloy", "format": "wav"},
    ("ChatCompletionRequest", "modalities"): ["text", "audio"],
    ("ChatCompletionRequest", "prediction"): {"type": "content", "content": "x"},
    ("ChatCompletionRequest", "reasoning_effort"): "low",
    ("ChatCompletionRequest", "verbosity"): "low",
    ("ChatCompletionRequest", "web_search_options"): {},
    ("ChatMessage", "role"): "tool",
    ("ChatMessage", "tool_calls"): [{"id": "t"}],
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
