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

    def __init__(self, arguments_key: str = ARGUMENTS_KEY) -> None:
        super().__init__()
        self._arguments_key = arguments_key
        self._state = "array"
        self._string = ""
        """The key or name read so far (between its quotes, still escaped)."""
        self._key = ""
        self._escaped = False
        self._nesting = _Nesting()

    def feed(self, text: str) -> ReaderUpdate:
        update = ReaderUpdate()
        arguments: list[str] = []
        for char in text:
            state = self._state
            if state == "arguments":
                arguments.append(char)
                if self._nesting.closes(char):
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
                    self._nesting = _Nesting(depth=1)
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
            return "arguments" if char == "{" and self._key == self._arguments_key else "malformed"
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


class TaggedCallsReader(ToolCallReader):
    """Calls the grammar enforced in the model's own format (a `tool_calls` constraint): each
    `{"name": ..., "arguments": {...}}` between `begin` and `end` (Hermes: `<tool_call>\\n`, `\\n</tool_call>`), or,
    where the request also has a `response_format`, a JSON answer instead, which is content.

    The tags are dropped and the objects go through RequiredCallsReader as if they were one array, so a call is
    sent as soon as its name is complete and its arguments as they are written.
    """

    def __init__(self, begin: str, end: str) -> None:
        super().__init__()
        self._begin, self._end = begin, end
        # The tags may be special tokens (Qwen's are), which the detokenizer keeps only when told.
        self.marker_tokens = (begin.strip(), end.strip())
        self._calls = RequiredCallsReader(arguments_key="arguments")
        self._mode = "start"
        """`start`, `content` (a JSON answer), `begin` / `end` (inside a tag), `call` (inside a call's JSON)."""
        self._matched = 0
        self._nesting = _Nesting()
        self._started = False

    def feed(self, text: str) -> ReaderUpdate:
        update = ReaderUpdate()
        inner: list[str] = []
        for char in text:
            if self._mode == "start":
                self._mode = "begin" if char == self._begin[0] else "content"
            if self._mode == "content":
                update.content += char
            elif self._mode in ("begin", "end"):
                tag = self._begin if self._mode == "begin" else self._end
                self._matched += 1
                if self._matched == len(tag):
                    self._matched = 0
                    if self._mode == "begin":
                        self._mode, self._nesting = "call", _Nesting()
                        inner.append("," if self._started else "[")
                        self._started = True
                    else:
                        self._mode = "between"
            elif self._mode == "between":
                self._mode, self._matched = "begin", 1
            else:
                inner.append(char)
                if self._nesting.closes(char):
                    self._mode = "end"
        if inner:
            update.calls.extend(self._calls.feed("".join(inner)).calls)
        return update

    def finish(self) -> ReaderUpdate:
        return ReaderUpdate()


class _Nesting:
    """Strings and brackets inside a JSON value, read a character at a time: where the value closes."""

    def __init__(self, depth: int = 0) -> None:
        self.depth = depth
        self.in_string = self.escaped = False

    def closes(self, char: str) -> bool:
        """Take the next character; True at the bracket that closes the value."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
        elif char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            return self.depth == 0
        return False
