"""gpt-oss's Harmony format (server/openai/harmony.py): conversations rendered and replies read by the
openai-harmony package, and the tool loop through the OpenAI SDK against a real server, chat completions and the
Responses API, streamed and not: reasoning in `reasoning_content` (or a reasoning item), the call in `tool_calls`
(a function_call item), its result sent back, the final answer as the content.

The model is a tiny gpt-oss trained on two scripted turns (tests/harmony_model.py); the parser's own behaviour
(chunking, the format breaking) is checked on token ids Harmony itself renders, without a model.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from openai_harmony import HarmonyEncoding, Message, Role

from engine.core.structured import CompiledGrammar, GrammarCompiler
from server.openai.errors import APIError
from server.openai.harmony import Harmony, HarmonyDelta, load_encoding
from server.openai.structured import Constraint, json_object_constraint, json_schema_constraint, regex_constraint
from server.openai.tools import ForcedFunction, FunctionTool
from tests.harmony_model import ANSWER, ARGUMENTS, QUESTION, REASONING, RESULT, WEATHER, build_harmony_model_dir
from tests.server_harness import running_server

pytestmark = pytest.mark.timeout(300)

TOOLS = [{"type": "function", "function": {"name": WEATHER.name, "description": WEATHER.description,
                                            "parameters": WEATHER.parameters}}]  # fmt: skip


@pytest.fixture(scope="module")
def encoding(tmp_path_factory: pytest.TempPathFactory) -> HarmonyEncoding:
    return load_encoding(tmp_path_factory.mktemp("tiktoken"))


# -- the reader, on Harmony's own renderings --------------------------------------------------------------------


def _reply(encoding: HarmonyEncoding, *messages: Message) -> list[int]:
    """What a model writes after `<|start|>assistant`: the messages rendered, less that first header."""
    tokens = [t for m in messages for t in encoding.render(m)]
    return tokens[2:]


def _read(
    encoding: HarmonyEncoding, tokens: list[int], seed: int, calls: bool = True
) -> tuple[HarmonyDelta, list[dict[str, str]]]:
    """`tokens` fed in random pieces: everything read, and the calls assembled from their deltas."""
    reader = Harmony(encoding, calls).reader()
    rng = random.Random(seed)
    total, calls = HarmonyDelta(), []
    i = 0
    while i < len(tokens):
        n = rng.randint(1, 4)
        delta = reader.feed(tokens[i : i + n])
        i += n
        total.content += delta.content
        total.reasoning += delta.reasoning
        total.reasoning_tokens += delta.reasoning_tokens
        for call in delta.calls:
            if call.id is not None:
                assert call.index == len(calls)
                calls.append({"name": call.name or "", "arguments": ""})
            calls[call.index]["arguments"] += call.arguments
    total.content += reader.finish()
    return total, calls


@pytest.mark.parametrize("seed", range(5))
def test_reasoning_and_a_call_come_apart_however_the_tokens_arrive(encoding: HarmonyEncoding, seed: int) -> None:
    tokens = _reply(
        encoding,
        Message.from_role_and_content(Role.ASSISTANT, "Let me look.").with_channel("analysis"),
        Message.from_role_and_content(Role.ASSISTANT, "Checking.").with_channel("commentary"),
        Message.from_role_and_content(Role.ASSISTANT, '{"city": "Oslo"}')
        .with_channel("commentary")
        .with_recipient("functions.get_weather")
        .with_content_type("<|constrain|>json"),
    )
    read, calls = _read(encoding, tokens, seed)
    assert (read.reasoning, read.content) == ("Let me look.", "Checking.")
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert 0 < read.reasoning_tokens < len(tokens)


def test_a_call_where_no_tool_was_offered_is_answer_text(encoding: HarmonyEncoding) -> None:
    tokens = _reply(
        encoding,
        Message.from_role_and_content(Role.ASSISTANT, "{}").with_channel("commentary").with_recipient("functions.x"),
    )
    read, calls = _read(encoding, tokens, 3, calls=False)
    assert (read.content, calls) == ("{}", [])


def test_the_final_channel_is_the_answer(encoding: HarmonyEncoding) -> None:
    tokens = _reply(
        encoding,
        Message.from_role_and_content(Role.ASSISTANT, "Easy.").with_channel("analysis"),
        Message.from_role_and_content(Role.ASSISTANT, "Héllo, wörld 🙂").with_channel("final"),
    )
    read, calls = _read(encoding, tokens, 0)
    assert (read.reasoning, read.content, calls) == ("Easy.", "Héllo, wörld 🙂", [])


def test_output_that_breaks_the_format_becomes_answer_text(encoding: HarmonyEncoding) -> None:
    """A small model may write anything: from the token the parser refuses, the rest is decoded as the answer."""
    start = encoding.encode("<|channel|>analysis<|message|>Hm.<|end|>", allowed_special="all")
    broken = encoding.encode("<|message|>plain 🙂 words", allowed_special="all")
    read, calls = _read(encoding, start + broken, 1)
    assert read.reasoning == "Hm." and calls == []
    assert read.content.endswith("plain 🙂 words")


def test_a_reply_without_any_header_is_the_answer(encoding: HarmonyEncoding) -> None:
    read, calls = _read(encoding, encoding.encode("Just words.<|return|>", allowed_special="all"), 2)
    assert (read.content, read.reasoning, calls) == ("Just words.", "", [])


# -- rendering --------------------------------------------------------------------------------------------------


def test_a_conversation_renders_as_harmony_writes_it(encoding: HarmonyEncoding) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Need it.",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {}}}],
        },
        {"role": "tool", "content": RESULT, "tool_call_id": "c", "name": "get_weather"},
    ]
    text = encoding.decode(Harmony(encoding).render(messages, [WEATHER], "low", "messages"))
    assert "Reasoning: low" in text
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in text and "type get_weather" in text
    assert "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{}" in text
    assert f"<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{RESULT}<|end|>" in text
    assert text.endswith("<|start|>assistant")


def test_what_harmony_cannot_honour_is_refused_by_the_field(encoding: HarmonyEncoding) -> None:
    harmony = Harmony(encoding)
    with pytest.raises(APIError) as refused:
        harmony.render([{"role": "user", "content": "x"}], [], "minimal", "messages")
    assert refused.value.info.param == "reasoning_effort" and "'low', 'medium' or 'high'" in refused.value.info.message
    with pytest.raises(APIError) as refused:  # a call the model must make, and an answer in a format: one or other
        harmony.constraint([WEATHER], "required", json_object_constraint("response_format"))
    assert refused.value.info.param == "response_format"
    with pytest.raises(APIError) as refused:  # the answer is one channel of several: JSON formats only
        harmony.constraint([WEATHER], "auto", regex_constraint("[a-z]+", "structured_outputs.regex"))
    assert refused.value.info.param == "structured_outputs.regex"
    assert harmony.offered_tools([WEATHER], "none") == []
    with pytest.raises(APIError) as refused:  # what every tool is checked for
        harmony.offered_tools([WEATHER, WEATHER], "auto")
    assert refused.value.info.param == "tools"


OTHER = FunctionTool("get_time", "The time in a city", {"type": "object", "properties": {"zone": {"type": "integer"}},
                                                        "required": ["zone"]})  # fmt: skip
SCHEMA = {"type": "object", "properties": {"sky": {"type": "string"}}, "required": ["sky"]}


def test_each_choice_makes_its_constraint(encoding: HarmonyEncoding) -> None:
    harmony = Harmony(encoding)
    answer = json_schema_constraint(SCHEMA, "response_format.json_schema.schema")
    assert harmony.constraint([WEATHER], "auto", None) is None  # a free reply
    assert harmony.constraint([WEATHER], "none", None) is None

    def spec(constraint: Constraint | None) -> tuple[dict[str, Any], str]:
        assert constraint is not None and constraint.output.kind == "harmony"
        return json.loads(constraint.output.spec), constraint.param

    calls = {WEATHER.name: WEATHER.arguments_schema, OTHER.name: OTHER.arguments_schema}
    assert spec(harmony.constraint([WEATHER, OTHER], "required", None)) == ({"answer": None, "calls": calls},
                                                                            "tool_choice")  # fmt: skip
    named = harmony.constraint([WEATHER, OTHER], ForcedFunction(OTHER.name), None, tool_choice_param="tool_choice")
    assert spec(named) == ({"answer": None, "calls": {OTHER.name: OTHER.arguments_schema}}, "tool_choice")
    assert spec(harmony.constraint([WEATHER], "auto", answer)) == (
        {"answer": SCHEMA, "calls": {WEATHER.name: WEATHER.arguments_schema}}, answer.param)  # fmt: skip
    assert spec(harmony.constraint([], "none", json_object_constraint("response_format"))) == (
        {"answer": {"type": "object"}, "calls": {}}, "response_format")  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_harmony_model_dir(tmp_path_factory.mktemp("gpt_oss_harmony"))


def _accepts(compiled: CompiledGrammar, encoding: HarmonyEncoding, reply: str) -> bool:
    """Whether the grammar lets a model write `reply` (Harmony's text, special tokens by name) and then stop."""
    matcher = compiled.matcher()
    return all(matcher.consume_token(t) for t in encoding.encode(reply, allowed_special="all")) and (
        matcher.is_accepting()
    )


def test_the_grammar_follows_harmonys_channels(model_dir: Path, encoding: HarmonyEncoding) -> None:
    """Compiled for the model's own tokenizer: reasoning is free, the last message is what the constraint asks."""
    harmony = Harmony(encoding)
    compiler = GrammarCompiler(str(model_dir))
    answer = json_schema_constraint(SCHEMA, "response_format")
    either = compiler.compile(harmony.constraint([WEATHER], "auto", answer).output)  # type: ignore[union-attr]
    call_only = compiler.compile(harmony.constraint([WEATHER, OTHER], ForcedFunction(OTHER.name), None).output)  # type: ignore[union-attr]
    reasoning = "<|channel|>analysis<|message|>Any text: {not json}<|end|><|start|>assistant"
    final = '<|channel|>final<|message|>{"sky": "sunny"}<|return|>'
    weather = f"<|channel|>commentary <|constrain|>json<|message|>{ARGUMENTS}<|call|>"
    time = '<|channel|>commentary <|constrain|>json<|message|>{"zone": 2}<|call|>'
    assert _accepts(either, encoding, reasoning + final)
    assert _accepts(either, encoding, final)
    assert _accepts(either, encoding, reasoning + " to=functions.get_weather" + weather)
    assert not _accepts(either, encoding, reasoning + reasoning + final)  # gpt-oss reasons once a turn
    assert not _accepts(either, encoding, reasoning + "<|channel|>final<|message|>Sunny.<|return|>")
    assert not _accepts(either, encoding, reasoning + '<|channel|>final<|message|>{"sky": 1}<|return|>')
    assert not _accepts(either, encoding, reasoning + " to=functions.get_time" + time)  # not offered here
    assert not _accepts(either, encoding, reasoning + '<|channel|>final<|message|>{"sky": "sunny"}')  # not ended
    assert _accepts(call_only, encoding, reasoning + " to=functions.get_time" + time)
    # The recipient after the channel, without the space or the content type: as Harmony's examples write calls.
    assert _accepts(call_only, encoding, '<|channel|>commentary to=functions.get_time<|message|>{"zone": 2}<|call|>')
    after = f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGUMENTS}<|call|>"
    assert _accepts(either, encoding, reasoning + after)
    assert not _accepts(call_only, encoding, reasoning + " to=functions.get_weather" + weather)
    assert not _accepts(call_only, encoding, reasoning + final)


# -- the tool loop through the SDK ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_url(model_dir: Path) -> Iterator[str]:
    with running_server(model_dir, "--num-pages", "64") as url:
        yield url


def _client(base_url: str) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key="unused")


def _second_turn(call_id: str) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}
        ]},
        {"role": "tool", "tool_call_id": call_id, "content": RESULT},
    ]  # fmt: skip


def test_chat_tool_loop(base_url: str) -> None:
    client = _client(base_url)
    first = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": QUESTION}],
        tools=TOOLS,
        temperature=0,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == REASONING[0]  # type: ignore[attr-defined]
    (call,) = choice.message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert not choice.message.content
    second = client.chat.completions.create(
        model=first.model, messages=_second_turn(call.id), tools=TOOLS, temperature=0
    )
    answer = second.choices[0]
    assert (answer.finish_reason, answer.message.content, answer.message.tool_calls) == ("stop", ANSWER, None)
    assert answer.message.reasoning_content == REASONING[1]  # type: ignore[attr-defined]


def test_chat_tool_loop_streamed(base_url: str) -> None:
    client = _client(base_url)
    model = client.models.list().data[0].id
    reasoning, content, names, arguments, finish = "", "", [], "", None
    for chunk in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], tools=TOOLS, temperature=0, stream=True
    ):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.function and call.function.name:
                names.append(call.function.name)
            arguments += (call.function.arguments if call.function else None) or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, content, names, json.loads(arguments), finish) == (
        REASONING[0], "", ["get_weather"], {"city": "Paris"}, "tool_calls",
    )  # fmt: skip
    text = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model=model, messages=_second_turn("call_x"), tools=TOOLS, temperature=0, stream=True
        )
    )
    assert text == ANSWER


@pytest.mark.parametrize("stream", [False, True])
def test_responses_tool_loop(base_url: str, stream: bool) -> None:
    client = _client(base_url)
    model = client.models.list().data[0].id
    tools = [{"type": "function", "name": WEATHER.name, "description": WEATHER.description,
              "parameters": WEATHER.parameters}]  # fmt: skip

    def respond(**kwargs: Any) -> Any:
        if not stream:
            return client.responses.create(model=model, tools=tools, temperature=0, store=False, **kwargs)
        with client.responses.stream(model=model, tools=tools, temperature=0, store=False, **kwargs) as events:
            return events.get_final_response()

    first = respond(input=QUESTION)
    kinds = [item.type for item in first.output]
    assert kinds == ["reasoning", "function_call"]
    assert first.output[0].content[0].text == REASONING[0]
    assert 0 < first.usage.output_tokens_details.reasoning_tokens < first.usage.output_tokens
    call = first.output[1]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    second = respond(
        input=[
            {"role": "user", "content": QUESTION},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": ARGUMENTS},
            {"type": "function_call_output", "call_id": call.call_id, "output": RESULT},
        ]
    )
    assert [item.type for item in second.output] == ["reasoning", "message"]
    assert second.output_text == ANSWER


def _chat(base_url: str, messages: list[dict[str, Any]], **fields: Any) -> httpx.Response:
    return httpx.post(
        f"{base_url}/v1/chat/completions",
        json={"model": _client(base_url).models.list().data[0].id, "messages": messages, **fields},
        timeout=60,
    )


def test_a_required_call_is_made_where_the_model_would_answer(base_url: str) -> None:
    """On the second turn the model answers; `required` holds it to a call, whose arguments follow the schema."""
    message = _client(base_url).chat.completions.create(
        model=_client(base_url).models.list().data[0].id, messages=_second_turn("call_0"), tools=TOOLS,
        tool_choice="required", max_tokens=128, temperature=0,
    ).choices[0]  # fmt: skip
    assert message.finish_reason == "tool_calls"
    (call,) = message.message.tool_calls
    assert call.function.name == WEATHER.name
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    # Reasoning stays free (its text is this tiny model's, whose margins a constrained step need not keep exactly).
    assert message.message.reasoning_content


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_is_called_where_the_model_would_answer(base_url: str, stream: bool) -> None:
    """On the second turn the model answers; naming the tool makes it call it (which tool among several a name picks
    is the grammar's test above: with other tools offered the prompt is not this model's script)."""
    forced = {"type": "function", "function": {"name": WEATHER.name}}
    if not stream:
        response = _chat(
            base_url, _second_turn("call_0"), tools=TOOLS, tool_choice=forced, max_tokens=128, temperature=0
        )
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        assert choice["message"]["reasoning_content"]
    else:
        chunks = _client(base_url).chat.completions.create(
            model=_client(base_url).models.list().data[0].id, messages=_second_turn("call_0"), tools=TOOLS,
            tool_choice=forced, stream=True, max_tokens=128, temperature=0,
        )  # fmt: skip
        calls = [call for chunk in chunks if chunk.choices for call in (chunk.choices[0].delta.tool_calls or [])]
        name = next(call.function.name for call in calls if call.function and call.function.name)
        arguments = "".join(call.function.arguments or "" for call in calls if call.function)
    assert name == WEATHER.name
    assert isinstance(json.loads(arguments)["city"], str)


def test_a_json_answer_after_free_reasoning(base_url: str) -> None:
    """On the second turn the model reasons, then answers in words; with a response format its reply is either an
    answer of the schema's JSON or (a call stays allowed under `auto`) a call with valid arguments, never words, in
    the chat API and the Responses API. Which of the two this tiny model picks varies with its training run."""
    schema = {"type": "object", "properties": {"sky": {"type": "string"}}, "required": ["sky"]}
    response = _chat(
        base_url, _second_turn("call_0"), tools=TOOLS, max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}},
    )  # fmt: skip
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["message"]["reasoning_content"]
    if choice["finish_reason"] == "tool_calls":
        (call,) = choice["message"]["tool_calls"]
        assert isinstance(json.loads(call["function"]["arguments"])["city"], str)
    elif choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"])["sky"], str)
    else:  # the budget ran out inside the answer: what came is a prefix of the schema's JSON
        assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith('{"sky": "'), choice
    client = _client(base_url)
    tools = [{"type": "function", "name": WEATHER.name, "description": WEATHER.description,
              "parameters": WEATHER.parameters}]  # fmt: skip
    reply = client.responses.create(
        model=client.models.list().data[0].id, tools=tools, max_output_tokens=64, store=False, temperature=0,
        text={"format": {"type": "json_schema", "name": "weather", "schema": schema}},
        input=[
            {"role": "user", "content": QUESTION},
            {"type": "function_call", "call_id": "call_0", "name": WEATHER.name, "arguments": ARGUMENTS},
            {"type": "function_call_output", "call_id": "call_0", "output": RESULT},
        ],
    )  # fmt: skip
    # The grammar lets the one analysis message be skipped: a reasoning item may or may not come first.
    kinds = [item.type for item in reply.output]
    assert kinds[:-1] in ([], ["reasoning"]) and kinds[-1] in ("message", "function_call"), kinds
    if kinds[-1] == "message":
        assert reply.output_text.startswith('{"sky": "')
    else:
        assert isinstance(json.loads(reply.output[-1].arguments)["city"], str)


def test_what_the_grammar_cannot_follow_is_a_400(base_url: str) -> None:
    question = [{"role": "user", "content": QUESTION}]
    regex = _chat(base_url, question, structured_outputs={"regex": "[a-z]+"})
    assert regex.status_code == 400 and regex.json()["error"]["param"] == "structured_outputs.regex"
    both = _chat(base_url, question, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert both.status_code == 400 and both.json()["error"]["param"] == "response_format"


def test_tokenize_counts_the_harmony_prompt(base_url: str, encoding: HarmonyEncoding) -> None:
    response = httpx.post(
        f"{base_url}/tokenize", json={"messages": [{"role": "user", "content": QUESTION}]}, timeout=60
    )
    expected = Harmony(encoding).render([{"role": "user", "content": QUESTION}], [], None, "messages")
    assert response.json()["tokens"] == expected
