"""Mistral calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or in the newer tokenizers' form
`[TOOL_CALLS]name[ARGS]{...}` once per call.

Text before the marker is content. What follows it is held back until the array (or the arguments object) is
complete, then sent as calls if every element is a call object, and as content, marker included, if not.
`[TOOL_CALLS]` and `[ARGS]` are special tokens, kept in the text for this parser (see `marker_tokens`).
"""

from __future__ import annotations

import json
import re

from server.openai.tool_parsers.base import (
    ReaderUpdate,
    ToolCallReader,
    call_from_json,
    json_value_end,
    partial_marker_length,
)

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")


class MistralToolParser(ToolCallReader):
    marker_tokens = (MARKER, ARGS)

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""
        self._in_calls = False
        self._after_call = False

    def feed(self, text: str) -> ReaderUpdate:
        self._pending += text
        return self._drain(final=False)

    def finish(self) -> ReaderUpdate:
        return self._drain(final=True)

    def _drain(self, final: bool) -> ReaderUpdate:
        update = ReaderUpdate()
        while self._pending:
            if not self._in_calls:
                start = self._pending.find(MARKER)
                if start < 0:
                    keep = 0 if final else partial_marker_length(self._pending, MARKER)
                    update.content += self._content(self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                update.content += self._content(self._pending[:start])
                self._pending = self._pending[start + len(MARKER) :]
                self._in_calls = True
                continue
            read = self._read_calls(self._pending)
            if read is None:  # incomplete
                if not final:
                    break
                read = (None, len(self._pending))
            calls, used = read
            raw = MARKER + self._pending[:used]
            self._pending = self._pending[used:]
            self._in_calls = False
            if calls is None:
                self._after_call = False
                update.content += raw
            else:
                for name, arguments in calls:
                    update.calls += self._whole_call(name, arguments)
                self._after_call = True
        if final and self._in_calls:  # the output ended right after the marker
            update.content += MARKER
            self._in_calls = False
        return update

    def _read_calls(self, text: str) -> tuple[list[tuple[str, str]] | None, int] | None:
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

    def _content(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return text


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
