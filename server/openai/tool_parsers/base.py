"""What every tool-call reader shares: the deltas it hands out, the calls they add up to, and the JSON helpers.

A reader takes one choice's output text as it is generated and splits it into content and tool calls. Each
`feed` returns what is now certain; `finish` (the output is complete) returns whatever was held back. A call
comes out as OpenAI streams it: a first delta with its index, id and name (arguments ""), then its arguments
in one or more pieces, so that a stream and a whole response assemble to the same calls.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ToolCallDelta:
    index: int
    """Which call of the choice, from 0."""
    id: str | None = None
    """Set on a call's first delta only, with `name`."""
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ReaderUpdate:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ReaderUpdate) -> ReaderUpdate:
        self.content += other.content
        self.calls.extend(other.calls)
        return self


@dataclass(slots=True)
class ParsedCall:
    """One whole call: what a response's `message.tool_calls` holds."""

    id: str
    name: str
    arguments: str
    """The arguments object as JSON text."""


CallText = tuple[str, str] | tuple[str, str, str]
"""A call read from output text: (name, arguments as JSON text), and the id the model wrote where its format has
one (Kimi K2's)."""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallReader(ABC):
    marker_tokens: tuple[str, ...] = ()
    """Special tokens of the format that the detokenizer must keep in the text (it drops special tokens)."""

    def __init__(self) -> None:
        self._num_calls = 0

    @abstractmethod
    def feed(self, text: str) -> ReaderUpdate:
        """Take the next piece of output text; return the content and call deltas that are now certain."""

    @abstractmethod
    def finish(self) -> ReaderUpdate:
        """The output is complete: return what was held back."""

    def _start_call(self, name: str, call_id: str | None = None) -> ToolCallDelta:
        delta = ToolCallDelta(self._num_calls, call_id or new_call_id(), name, "")
        self._num_calls += 1
        return delta

    def _arguments(self, text: str) -> ToolCallDelta:
        return ToolCallDelta(self._num_calls - 1, arguments=text)

    def _whole_call(self, name: str, arguments: str, call_id: str | None = None) -> list[ToolCallDelta]:
        """A call read in one go: its first delta, then its arguments."""
        return [self._start_call(name, call_id), self._arguments(arguments)]


class BufferedReader(ToolCallReader):
    """A reader of a text format: output text gathers in `_pending` until `_drain` can settle it."""

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""

    def feed(self, text: str) -> ReaderUpdate:
        self._pending += text
        return self._drain(final=False)

    def finish(self) -> ReaderUpdate:
        return self._drain(final=True)

    @abstractmethod
    def _drain(self, final: bool) -> ReaderUpdate:
        """What `_pending` settles now; with `final`, everything (the output is complete)."""


class MarkedCallsReader(BufferedReader):
    """A format whose calls follow a marker in the text (Hermes' `<tool_call>`, Mistral's `[TOOL_CALLS]`).

    Text before a marker is content (a part of a marker at the end is held back). What follows a marker is held
    back until `_read_calls` settles it: sent as calls, or as content (marker included) when it is not calls.
    Whitespace right after calls is layout, not content.
    """

    marker: str

    def __init__(self) -> None:
        super().__init__()
        self._in_calls = False
        self._after_call = False

    @abstractmethod
    def _read_calls(self, text: str, final: bool) -> tuple[list[CallText] | None, int] | None:
        """Of the text after a marker: the calls it starts with, or None when it is not calls,
        and how many characters they take; None while incomplete (never with `final`)."""

    def _drain(self, final: bool) -> ReaderUpdate:
        update = ReaderUpdate()
        marker = self.marker
        while self._pending:
            if not self._in_calls:
                start = self._pending.find(marker)
                if start < 0:
                    keep = 0 if final else partial_marker_length(self._pending, marker)
                    update.content += self._content(self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                update.content += self._content(self._pending[:start])
                self._pending = self._pending[start + len(marker) :]
                self._in_calls = True
                continue
            read = self._read_calls(self._pending, final)
            if read is None:
                break
            calls, used = read
            raw = marker + self._pending[:used]
            self._pending = self._pending[used:]
            self._in_calls = False
            if calls is None:
                self._after_call = False
                update.content += raw
            else:
                for call in calls:
                    update.calls += self._whole_call(*call)
                self._after_call = True
        if final and self._in_calls:  # the output ended right after the marker
            update.content += marker
            self._in_calls = False
        return update

    def _content(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return text


def json_value_end(text: str, start: int) -> int | None:
    """The index just past the JSON object or array opening at `text[start]`, or None while it is incomplete.

    Brackets are counted outside strings only; whether the value is valid JSON is for json.loads to say.
    """
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        char = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def call_from_json(value: Any, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call object such as `{"name": ..., "arguments": {...}}`; None if it is
    not one. Arguments given as JSON text (some models quote them) are taken as they are when they parse."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    keys = [key for key in arguments_keys if key in value]
    if set(value) - {"name", *keys} or len(keys) > 1:
        return None
    arguments = value[keys[0]] if keys else {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def partial_marker_length(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker` (held back until it is settled)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
