"""Hermes / Qwen calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call.

Text outside the blocks is content. A block is held back until its closing tag, then sent as a call if it holds
one call object and as content (tags included) if it does not; at the end of the output an unclosed block is
read the same way (models sometimes stop right after the JSON). Whitespace between blocks is layout, not content.
"""

from __future__ import annotations

import json

from server.openai.tool_parsers.base import ReaderUpdate, ToolCallReader, call_from_json, partial_marker_length

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolCallReader):
    marker_tokens = (START, END)

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""
        self._in_call = False
        self._after_call = False

    def feed(self, text: str) -> ReaderUpdate:
        self._pending += text
        return self._drain(final=False)

    def finish(self) -> ReaderUpdate:
        return self._drain(final=True)

    def _drain(self, final: bool) -> ReaderUpdate:
        update = ReaderUpdate()
        while self._pending:
            if not self._in_call:
                start = self._pending.find(START)
                if start < 0:
                    keep = 0 if final else partial_marker_length(self._pending, START)
                    update.content += self._content(self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                update.content += self._content(self._pending[:start])
                self._pending = self._pending[start + len(START) :]
                self._in_call = True
                continue
            end = self._pending.find(END)
            if end < 0 and not final:
                break
            body = self._pending if end < 0 else self._pending[:end]
            block = START + (self._pending if end < 0 else self._pending[: end + len(END)])
            self._pending = "" if end < 0 else self._pending[end + len(END) :]
            self._in_call = False
            call = _parse_block(body)
            if call is None:
                self._after_call = False
                update.content += block
            else:
                update.calls += self._whole_call(*call)
                self._after_call = True
        if final and self._in_call:  # the output ended right after the opening tag
            update.content += START
            self._in_call = False
        return update

    def _content(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return text


def _parse_block(body: str) -> tuple[str, str] | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    return call_from_json(value)
