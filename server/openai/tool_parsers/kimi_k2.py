"""Kimi K2 calls: a section `<|tool_calls_section_begin|>` ... `<|tool_calls_section_end|>` holding, per call,
`<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}<|tool_call_end|>`. Every marker is a
special token, kept in the text for this parser (see `marker_tokens`); whitespace between them is layout.

A call's id is what the model wrote before its arguments (`functions.get_weather:0`): Kimi's chat template writes
each earlier call's id back into the conversation (after `<|tool_call_begin|>`, and as a tool result's `## Return
of {id}`), so the id a client gets back is the model's own, not a new one.

Text before a section is content. A section is held back until it closes (or the output ends: models stop at their
end-of-turn token, a closing marker or two early), then sent as calls if every call in it is well formed (a name, a
JSON object of arguments), and as content, markers included, if not.
"""

from __future__ import annotations

import json
import re

from server.openai.tool_parsers.base import CallText, MarkedCallsReader, call_from_json

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENTS_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_ID = re.compile(r"(?:functions\.)?([A-Za-z0-9_.-]{1,64}):\d+")


class KimiK2ToolParser(MarkedCallsReader):
    marker_tokens = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENTS_BEGIN, CALL_END)
    marker = SECTION_BEGIN

    def _read_calls(self, text: str, final: bool) -> tuple[list[CallText] | None, int] | None:
        end = text.find(SECTION_END)
        if end < 0 and not final:
            return None
        body, used = (text, len(text)) if end < 0 else (text[:end], end + len(SECTION_END))
        return _read_section(body), used


def _read_section(body: str) -> list[CallText] | None:
    """The calls of a section's text (None if any is malformed, or there are none); a last call without its
    closing marker is read as if it had one."""
    calls: list[CallText] = []
    rest = body.strip()
    while rest:
        if not rest.startswith(CALL_BEGIN):
            return None
        end = rest.find(CALL_END)
        call, rest = (rest, "") if end < 0 else (rest[:end], rest[end + len(CALL_END) :].strip())
        call_id, found, arguments = call[len(CALL_BEGIN) :].partition(ARGUMENTS_BEGIN)
        call_id = call_id.strip()
        named = _ID.fullmatch(call_id)
        if not found or named is None:
            return None
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            return None
        read = call_from_json({"name": named[1], "arguments": value})
        if read is None:
            return None
        calls.append((*read, call_id))
    return calls or None
