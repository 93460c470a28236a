"""Tool-call readers on scripted model texts: each model format (Hermes / Qwen, Kimi K2, Llama 3.x JSON, Mistral), the
readers of grammar-enforced calls, and the format detection from chat templates.

Every text is read whole and in small pieces (as a stream delivers it): both must give the same content and
calls, since a stream and a whole response go through the same reader.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.openai.tool_parsers import TOOL_CALL_PARSERS, detect_tool_call_parser
from server.openai.tool_parsers.base import ReaderUpdate, ToolCallReader
from server.openai.tool_parsers.enforced import NamedCallReader, RequiredCallsReader, TaggedCallsReader

Calls = list[tuple[str, dict]]
DEMO_TEMPLATE = Path(__file__).resolve().parents[1] / "server" / "default_model" / "chat_template.jinja"


def read(reader: ToolCallReader, text: str, piece: int) -> tuple[str, Calls, list[ReaderUpdate]]:
    """(content, [(name, arguments)], the updates) of `text` fed `piece` characters at a time (0: whole). A call's
    id is a new one (`call_...`), or with Kimi K2 the one the model wrote (`functions.NAME:INDEX`)."""
    step = piece or max(len(text), 1)
    updates = [reader.feed(text[i : i + step]) for i in range(0, len(text), step)] + [reader.finish()]
    assembled: dict[int, list] = {}
    for update in updates:
        for delta in update.calls:
            if delta.id is not None:
                own_id = f"functions.{delta.name}:"
                assert delta.index == len(assembled) and delta.id.startswith(("call_", own_id)) and delta.name
                assembled[delta.index] = [delta.name, delta.arguments]
            else:
                assert delta.name is None and delta.index in assembled, "arguments come after their call's name"
                assembled[delta.index][1] += delta.arguments
    content = "".join(update.content for update in updates)
    return content, [(name, json.loads(arguments)) for name, arguments in assembled.values()], updates


def check(parser: str, text: str, content: str, calls: Calls) -> None:
    for piece in (0, 1, 2, 5):
        got_content, got_calls, _ = read(TOOL_CALL_PARSERS[parser](), text, piece)
        assert (got_content, got_calls) == (content, calls), f"read {piece or 'whole'} characters at a time"


WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
TIME = ("get_time", {"zone": "Europe/Paris"})


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>', "",
         [WEATHER]),
        ('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
         '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n'
         "</tool_call>", "Let me look that up.\n", [WEATHER, TIME]),
        # Some models quote the arguments; stopping right after the JSON (no closing tag) still makes a call.
        ('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"Europe/Paris\\"}"}', "", [TIME]),
        ("No tools needed: 2 < 3 and <b>bold</b>.", "No tools needed: 2 < 3 and <b>bold</b>.", []),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Par</tool_call> then',
         '<tool_call>{"name": "get_weather", "arguments": {"city": "Par</tool_call> then', []),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
        ("ends inside a tag <tool_", "ends inside a tag <tool_", []),
        ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>\nDone.', "Done.",
         [TIME]),
    ],
)  # fmt: skip
def test_hermes(text: str, content: str, calls: Calls) -> None:
    check("hermes", text, content, calls)


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "", [WEATHER]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
         '{"name": "get_time", "parameters": {"zone": "Europe/Paris"}}', "", [WEATHER, TIME]),
        ('  {"name": "get_time", "arguments": {"zone": "Europe/Paris"}}', "", [TIME]),
        ('The answer is {"name": "get_time", "parameters": {}}', 'The answer is {"name": "get_time", "parameters": {}}',
         []),
        ('{"city": "Paris"}', '{"city": "Paris"}', []),
        ('{"name": "get_weather", "parameters": {"city": "Par', '{"name": "get_weather", "parameters": {"city": "Par',
         []),
        ('{"name": "get_time", "parameters": {"zone": "Europe/Paris"}} and more', "and more", [TIME]),
    ],
)  # fmt: skip
def test_llama3_json(text: str, content: str, calls: Calls) -> None:
    check("llama3_json", text, content, calls)


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
         '{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}]', "", [WEATHER, TIME]),
        ('Sure. [TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}]', "Sure. ", [TIME]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]'
         '{"zone": "Europe/Paris"}', "", [WEATHER, TIME]),
        ('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": ]', '[TOOL_CALLS][{"name": "get_time", '
         '"arguments": {"zone": ]', []),
        ('[TOOL_CALLS][{"name": 7}] and text', '[TOOL_CALLS][{"name": 7}] and text', []),
        ("Brackets [like these] are content.", "Brackets [like these] are content.", []),
        ('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "Euro', '[TOOL_CALLS][{"name": "get_time", '
         '"arguments": {"zone": "Euro', []),
    ],
)  # fmt: skip
def test_mistral(text: str, content: str, calls: Calls) -> None:
    check("mistral", text, content, calls)


KIMI_WEATHER = (
    "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris", "unit": "celsius"}<|tool_call_end|>'
)
KIMI_TIME = (
    '<|tool_call_begin|> functions.get_time:1 <|tool_call_argument_begin|> {"zone": "Europe/Paris"} <|tool_call_end|>'
)


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (f"<|tool_calls_section_begin|>{KIMI_WEATHER}<|tool_calls_section_end|>", "", [WEATHER]),
        (f"Let me look.<|tool_calls_section_begin|>{KIMI_WEATHER}\n{KIMI_TIME}<|tool_calls_section_end|> Done.",
         "Let me look.Done.", [WEATHER, TIME]),
        # The output ended before the closing markers (a stop token right after the arguments).
        (f"<|tool_calls_section_begin|>{KIMI_TIME.removesuffix('<|tool_call_end|>')}", "", [TIME]),
        # Not calls: a malformed id, arguments that are not an object, a section without calls.
        ("<|tool_calls_section_begin|><|tool_call_begin|>get_time<|tool_call_argument_begin|>{}<|tool_call_end|>"
         "<|tool_calls_section_end|>", "<|tool_calls_section_begin|><|tool_call_begin|>get_time"
         "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>", []),
        ("<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>[1]"
         "<|tool_call_end|>", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
         "<|tool_call_argument_begin|>[1]<|tool_call_end|>", []),
        ("<|tool_calls_section_begin|><|tool_calls_section_end|>", "<|tool_calls_section_begin|>"
         "<|tool_calls_section_end|>", []),
        ("A <|tool_calls_section text", "A <|tool_calls_section text", []),
    ],
)  # fmt: skip
def test_kimi_k2(text: str, content: str, calls: Calls) -> None:
    check("kimi_k2", text, content, calls)


def test_kimi_k2_calls_keep_the_ids_the_model_wrote() -> None:
    text = f"<|tool_calls_section_begin|>{KIMI_WEATHER}{KIMI_TIME}<|tool_calls_section_end|>"
    for piece in (0, 3):
        _, _, updates = read(TOOL_CALL_PARSERS["kimi_k2"](), text, piece)
        ids = [delta.id for update in updates for delta in update.calls if delta.id is not None]
        assert ids == ["functions.get_weather:0", "functions.get_time:1"]


def test_a_hermes_call_is_held_back_until_complete_then_sent_name_first() -> None:
    reader = TOOL_CALL_PARSERS["hermes"]()
    assert reader.feed("Checking. <tool") == ReaderUpdate("Checking. ", [])
    assert reader.feed('_call>{"name": "get_time", "arguments": {"zone": ') == ReaderUpdate()
    update = reader.feed('"UTC"}}</tool_call>')
    first, arguments = update.calls
    assert (first.index, first.name, first.arguments) == (0, "get_time", "")
    assert (arguments.index, arguments.id, arguments.name, json.loads(arguments.arguments)) == (
        0, None, None, {"zone": "UTC"},
    )  # fmt: skip


def test_required_calls_stream_name_first_then_arguments_as_generated() -> None:
    text = (
        '[{"name":"get_weather","parameters":{"city":"Pa\\"ris}","tags":[1,{"a":"]"}]}},'
        '{"name":"get_time","parameters":{}}]'
    )
    for piece in (0, 1, 3):
        content, calls, _ = read(RequiredCallsReader(), text, piece)
        assert content == "" and calls == [
            ("get_weather", {"city": 'Pa"ris}', "tags": [1, {"a": "]"}]}),
            ("get_time", {}),
        ]
    reader = RequiredCallsReader()
    assert [(d.name, d.arguments) for d in reader.feed(text[:24]).calls] == [("get_weather", "")], "name first"
    assert [(d.name, d.arguments) for d in reader.feed('parameters":{"ci').calls] == [(None, '{"ci')]
    assert [d.arguments for d in reader.feed('ty":"Paris"').calls] == ['ty":"Paris"'], "arguments as generated"
    truncated = RequiredCallsReader().feed('[{"name":"get_time","parameters":{"zone":"Eu')
    assert "".join(d.arguments for d in truncated.calls) == '{"zone":"Eu', "a cut-off answer keeps what it has"


def test_tagged_calls_stream_like_required_ones_and_a_json_answer_is_content() -> None:
    """Calls enforced in the model's own format: tags dropped, each name as soon as it is complete, the
    arguments as generated; a JSON answer (auto beside response_format) is the content."""
    tags = ("<tool_call>\n", "\n</tool_call>")
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "tags": [1, {"a": "]"}]}}\n'
        '</tool_call><tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    for piece in (0, 1, 3):
        content, calls, _ = read(TaggedCallsReader(*tags), text, piece)
        assert content == "" and calls == [
            ("get_weather", {"city": 'Pa"ris}', "tags": [1, {"a": "]"}]}),
            ("get_time", {}),
        ]
    reader = TaggedCallsReader(*tags)
    assert [(d.name, d.arguments) for d in reader.feed(text[:35]).calls] == [("get_weather", "")], "name first"
    assert [d.arguments for d in reader.feed(text[35 : text.index('{"ci') + 4]).calls] == ['{"ci'], "as generated"
    assert reader.marker_tokens == ("<tool_call>", "</tool_call>")
    content, calls, _ = read(TaggedCallsReader(*tags), '{"city": "Oslo"}', 2)
    assert content == '{"city": "Oslo"}' and calls == []


def test_named_call_is_the_whole_answer() -> None:
    content, calls, updates = read(NamedCallReader("get_time"), '{"zone":"UTC"}', 2)
    assert content == "" and calls == [("get_time", {"zone": "UTC"})]
    assert updates[0].calls[0].name == "get_time" and updates[0].calls[0].arguments == ""


def test_the_parser_is_detected_from_the_chat_template() -> None:
    assert detect_tool_call_parser(DEMO_TEMPLATE.read_text()) == "hermes"
    assert detect_tool_call_parser("{% for m in messages %}[TOOL_CALLS]{{ m.content }}{% endfor %}") == "mistral"
    llama = '<|start_header_id|>ipython<|end_header_id|> respond with {"name": function name, "parameters": ...}'
    assert detect_tool_call_parser(llama) == "llama3_json"
    kimi = "{% for c in m.tool_calls %}<|tool_calls_section_begin|><|tool_call_begin|>{{ c.id }}{% endfor %}"
    assert detect_tool_call_parser(kimi) == "kimi_k2"
    assert detect_tool_call_parser("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert detect_tool_call_parser(None) is None
