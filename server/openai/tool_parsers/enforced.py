"""Readers of calls the grammar enforced (`tool_choice` required or a named function), streamed as generated.

The engine constrains these outputs to a known JSON shape (server/openai/tools.py builds it), so a call can be
sent the moment its name is complete and its arguments character by character: there is nothing to take back.
An answer the length limit cut short keeps the calls as far as they got, as OpenAI's do.
"""

from __future__ import annotations

import json

from server.openai.tool_parsers.base import ReaderUpdate, ToolCallReader

NAME_KEY, ARGUMENTS_KEY = "name", "parameters"
"""The keys of each element of a `required` answer (vLLM's shape)."""


class NamedCallReader(ToolCallReader):
    """A named `tool_choice`: the whole answer is the arguments object of that one function."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def feed(self, text: str) -> ReaderUpdate:
        update = ReaderUpdate()
        if self._num_calls == 0:
            update.calls.append(self._start_call(self._name))
        if text:
            update.calls.append(self._arguments(text))
        return update

    def finish(self) -> ReaderUpdate:
        return self.feed("")


class RequiredCallsReader(ToolCallReader):
    """`tool_choice: required`: the answer is a JSON array of `{"name": ..., "parameters": {...}}` objects.

    A small state machine over the characters: it reads each element's name, then passes the arguments object's
    characters through until its closing brace (counted outside strings).
    """

    def __init__(self) -> None:
        super().__init__()
        self._state = "array"
        self._string = ""
        """The key or name read so far (between its quotes, still escaped)."""
        self._key = ""
        self._escaped = False
        self._in_string = False
        self._depth = 0

    def feed(self, text: str) -> ReaderUpdate:
        update = ReaderUpdate()
        arguments: list[str] = []
        for char in text:
            state = self._state
            if state == "arguments":
                arguments.append(char)
                if self._closes_arguments(char):
                    self._state = "after_value"
                    update.calls.append(self._arguments("".join(arguments)))
                    arguments = []
            elif state in ("key", "name"):
                self._string_char(char, update)
            elif state == "malformed":
                update.content += char
            elif not char.isspace():
                self._state = self._next_state(char)
                if self._state == "arguments":
                    arguments.append(char)
                    self._depth, self._in_string = 1, False
                elif self._state == "malformed":
                    update.content += char
        if arguments:
            update.calls.append(self._arguments("".join(arguments)))
        return update

    def finish(self) -> ReaderUpdate:
        return ReaderUpdate()

    def _next_state(self, char: str) -> str:
        """The state after a structural character. The grammar allows nothing else; should anything else come,
        the rest of the answer is kept as content rather than guessed at."""
        if self._state == "value":
            if char == '"' and self._key == NAME_KEY:
                self._string = ""
                return "name"
            return "arguments" if char == "{" and self._key == ARGUMENTS_KEY else "malformed"
        if self._state == "before_key" and char == '"':
            self._string = ""
        return _TRANSITIONS.get((self._state, char), "malformed")

    def _string_char(self, char: str, update: ReaderUpdate) -> None:
        if self._escaped:
            self._escaped = False
        elif char == "\\":
            self._escaped = True
        elif char == '"':
            text = json.loads(f'"{self._string}"')
            if self._state == "key":
                self._key, self._state = text, "colon"
            else:
                update.calls.append(self._start_call(text))
                self._state = "after_value"
            return
        self._string += char

    def _closes_arguments(self, char: str) -> bool:
        """Track strings and nesting inside the arguments object; True at its closing brace."""
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            return self._depth == 0
        return False


_TRANSITIONS = {
    ("array", "["): "element",
    ("element", "{"): "before_key",
    ("before_key", '"'): "key",
    ("colon", ":"): "value",
    ("after_value", ","): "before_key",
    ("after_value", "}"): "next_element",
    ("next_element", ","): "element",
    ("next_element", "]"): "done",
}
