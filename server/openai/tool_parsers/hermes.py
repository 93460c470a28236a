"""Hermes / Qwen calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call.

Text outside the blocks is content. A block is held back until its closing tag, then sent as a call if it holds
one call object and as content (tags included) if it does not; at the end of the output an unclosed block is
read the same way (models sometimes stop right after the JSON). Whitespace between blocks is layout, not content.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from server.openai.tool_parsers.base import CallText, MarkedCallsReader, call_from_json

START, END = "<tool_call>", "</tool_call>"
_PROBE = {"name": "ferry_probe", "arguments": {"x": 1}}


class HermesToolParser(MarkedCallsReader):
    marker_tokens = (START, END)
    marker = START

    def _read_calls(self, text: str, final: bool) -> tuple[list[CallText] | None, int] | None:
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


def call_tags(render_call: Callable[[dict[str, Any]], str]) -> tuple[str, str] | None:
    """The text before and after one call object as this model's chat template writes a call (`render_call`
    renders a conversation whose assistant turn makes the given call): the demo model's `<tool_call>\\n` and
    `\\n</tool_call>`, another template's without the newlines. What the grammar writes when a call must come, so
    the model sees its own format. None where the template does not write the object as the grammar would."""
    text = render_call(_PROBE)
    at = text.rfind(_PROBE["name"])  # the call, after any mention in a tools list
    start, end = text.rfind(START, 0, at), text.find(END, at)
    if at < 0 or start < 0 or end < 0:
        return None
    inner = text[start + len(START) : end]
    first, last = inner.find("{"), inner.rfind("}")
    if json.dumps(_PROBE) != inner[first : last + 1]:
        return None
    return START + inner[:first], inner[last + 1 :] + END
