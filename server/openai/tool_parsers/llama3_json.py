"""Llama 3.x JSON calls: the answer is `{"name": ..., "parameters": {...}}` (several joined by `;`), optionally
after `<|python_tag|>`.

Only an answer that starts with a call object (or the tag) is read for calls; anything else is content from the
first character. Each object is held back until it is complete, then sent as a call; the first thing that is not a
call object turns the rest of the answer into content.
"""

from __future__ import annotations

import json

from server.openai.tool_parsers.base import BufferedReader, ReaderUpdate, call_from_json, json_value_end

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(BufferedReader):
    marker_tokens = (PYTHON_TAG,)

    def __init__(self) -> None:
        super().__init__()
        self._mode = "start"
        """start (nothing settled yet), calls (reading call objects) or content (everything else is content)."""

    def _drain(self, final: bool) -> ReaderUpdate:
        update = ReaderUpdate()
        if self._mode == "start":
            head = self._pending.lstrip()
            if head.startswith(PYTHON_TAG):
                self._pending = head[len(PYTHON_TAG) :]
                self._mode = "calls"
            elif head.startswith("{"):
                self._mode = "calls"
            elif (head and not PYTHON_TAG.startswith(head)) or final:
                self._mode = "content"
            else:
                return update
        while self._mode == "calls":
            text = self._pending.lstrip().lstrip(";").lstrip()
            if not text.startswith("{"):
                if text or final:
                    self._mode = "content"
                    self._pending = text
                break
            end = json_value_end(text, 0)
            if end is None:
                if final:
                    self._mode = "content"
                    self._pending = text
                break
            call = _parse_object(text[:end])
            if call is None:
                self._mode = "content"
                self._pending = text
                break
            update.calls += self._whole_call(*call)
            self._pending = text[end:]
        if self._mode == "content":
            update.content += self._pending
            self._pending = ""
        return update


def _parse_object(text: str) -> tuple[str, str] | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return call_from_json(value)
