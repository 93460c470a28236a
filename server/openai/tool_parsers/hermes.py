"""Hermes / Qwen calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call.

Text outside the blocks is content. A block is held back until its closing tag, then sent as a call if it holds
one call object and as content (tags included) if it does not; at the end of the output an unclosed block is
read the same way (models sometimes stop right after the JSON). Whitespace between blocks is layout, not content.
"""

from __future__ import annotations

import json

from server.openai.tool_parsers.base import MarkedCallsReader, call_from_json

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(MarkedCallsReader):
    marker_tokens = (START, END)
    marker = START

    def _read_calls(self, text: str, final: bool) -> tuple[list[tuple[str, str]] | None, int] | None:
        end = text.find(END)
        if end < 0 and not final:
            return None
        # An unclosed block at the end of the output is read as if it were closed.
        body, used = (text, len(text)) if end < 0 else (text[:end], end + len(END))
        call = _parse_block(body)
        return (None if call is None else [call]), used


def _parse_block(body: str) -> tuple[str, str] | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    return call_from_json(value)
