"""Mistral calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or in the newer tokenizers' form
`[TOOL_CALLS]name[ARGS]{...}` once per call.

Text before the marker is content. What follows it is held back until the array (or the arguments object) is
complete, then sent as calls if every element is a call object, and as content, marker included, if not.
`[TOOL_CALLS]` and `[ARGS]` are special tokens, kept in the text for this parser (see `marker_tokens`).
"""

from __future__ import annotations

import json
import re

from server.openai.tool_parsers.base import CallText, MarkedCallsReader, call_from_json, json_value_end

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")


class MistralToolParser(MarkedCallsReader):
    marker_tokens = (MARKER, ARGS)
    marker = MARKER

    def _read_calls(self, text: str, final: bool) -> tuple[list[CallText] | None, int] | None:
        read = self._read_complete_calls(text)
        # Still incomplete when the output ends: not calls, all of it content.
        return (None, len(text)) if read is None and final else read

    @staticmethod
    def _read_complete_calls(text: str) -> tuple[list[CallText] | None, int] | None:
        """(calls or None if malformed, characters used) of the text after a marker; None while incomplete."""
        offset = len(text) - len(text.lstrip())
        if offset == len(text):
            return None
        if text[offset] == "[":
            end = json_value_end(text, offset)
            if end is None:
                return None
            value = _loads(text[offset:end])
            if not (isinstance(value, list) and value):
                return None, end
            calls = [call_from_json(item) for item in value]
            return ([call for call in calls if call is not None] if all(calls) else None), end
        args = text.find(ARGS, offset)
        if args < 0:
            return None
        name = text[offset:args].strip()
        start = args + len(ARGS)
        body = text[start:].lstrip()
        if not body:
            return None
        if not _NAME.match(name) or not body.startswith("{"):
            return None, start
        start = len(text) - len(body)
        end = json_value_end(text, start)
        if end is None:
            return None
        call = call_from_json({"name": name, "arguments": _loads(text[start:end])})
        return (None if call is None else [call]), end


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
