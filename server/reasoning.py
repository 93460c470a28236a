"""Reasoning output: the `<think>…</think>` part of a reasoning model's text, split from the answer as it streams.

What comes before `</think>` is reasoning (`reasoning_content` in chat, a `reasoning` item in the Responses API);
what follows is the answer (`content`), the only text that tool-call parsing and the client's answer see. Tags
split across tokens or deltas are held back until the following text settles them, so a stream and a whole
response split alike. Newlines around the reasoning are dropped, as the templates of these models do when they
render a past turn (`content.split('</think>')[-1].lstrip('\\n')`).

Two styles, as `--reasoning-parser` names them:
- `qwen3`: the output opens its reasoning with `<think>` (leading whitespace allowed), unless the prompt already
  did (templates of thinking-only models end the generation prompt with `<think>`); otherwise it is all answer.
- `deepseek_r1`: the output starts in reasoning whatever the prompt ends with (DeepSeek-R1 often omits the
  opening tag); a leading `<think>` is dropped.
Either way, reasoning that never reaches `</think>` (the token limit cut it short) is all reasoning, no answer.
Where the tags are special tokens of the vocabulary (Kimi K2 Thinking's), the detokenizer keeps them in the text
this reads (`MARKER_TOKENS`), as it keeps a tool-call format's markers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # the settings import this module, and the engine process imports them: no tokenizer libraries
    from server.tokens import Tokenizer

ReasoningParserName = Literal["auto", "none", "qwen3", "deepseek_r1"]

THINK_START, THINK_END = "<think>", "</think>"
MARKER_TOKENS = (THINK_START, THINK_END)
"""Special tokens the detokenizer must keep in the text for the splitter (it drops special tokens)."""


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    reasoning: str
    content: str


class _State(enum.Enum):
    OPENING = enum.auto()  # the output's start: an opening tag may still come
    REASONING = enum.auto()
    CONTENT = enum.auto()


@dataclass(frozen=True)
class ReasoningParser:
    name: ReasoningParserName
    starts_in_reasoning: bool
    """deepseek_r1: always. qwen3: only when the prompt opened the reasoning block."""

    @classmethod
    def for_model(cls, name: ReasoningParserName, tokenizer: Tokenizer) -> ReasoningParser | None:
        """The parser `name` picks for this model; `auto` picks qwen3 for a template that knows `</think>`."""
        if name == "auto":
            name = "qwen3" if THINK_END in (tokenizer.chat_template or "") else "none"
        if name == "none":
            return None
        return cls(name, starts_in_reasoning=name == "deepseek_r1")

    def splitter(self, prompt_text: str) -> ReasoningSplitter:
        """A splitter for one choice whose rendered prompt is `prompt_text`."""
        in_reasoning = self.starts_in_reasoning or prompt_text.rstrip().endswith(THINK_START)
        return ReasoningSplitter(in_reasoning)


class ReasoningSplitter:
    """One choice's text deltas in, (reasoning, content) deltas out; their concatenations do not depend on how
    the text was chunked."""

    def __init__(self, in_reasoning: bool) -> None:
        self._without_opening_tag = _State.REASONING if in_reasoning else _State.CONTENT
        self._state = _State.OPENING
        self._pending = ""
        self._reasoning_started = False
        self._answer_starts = False
        """`</think>` was just seen: the newlines that follow it are not the answer's."""

    @property
    def in_reasoning(self) -> bool:
        return self._state is _State.REASONING or (
            self._state is _State.OPENING and self._without_opening_tag is _State.REASONING
        )

    def feed(self, text: str) -> ReasoningDelta:
        self._pending += text
        reasoning = content = ""
        if self._state is _State.OPENING:
            head = self._pending.lstrip()
            if head.startswith(THINK_START):
                self._pending = head[len(THINK_START) :]
                self._state = _State.REASONING
            elif THINK_START.startswith(head):
                return ReasoningDelta("", "")  # whitespace, or the start of an opening tag: wait for more
            else:
                self._state = self._without_opening_tag
        if self._state is _State.REASONING:
            end = self._pending.find(THINK_END)
            if end < 0:
                return ReasoningDelta(self._take_reasoning(final=False), "")
            reasoning = self._emit_reasoning(self._pending[:end].rstrip("\n"))
            self._pending = self._pending[end + len(THINK_END) :]
            self._state = _State.CONTENT
            self._answer_starts = True
        content = self._take_content()
        return ReasoningDelta(reasoning, content)

    def flush(self) -> ReasoningDelta:
        """The text is complete: whatever was held back belongs where the stream stands."""
        if self._state is _State.OPENING:
            self._state = self._without_opening_tag
        if self._state is _State.REASONING:
            return ReasoningDelta(self._take_reasoning(final=True), "")
        return ReasoningDelta("", self._take_content())

    def _take_reasoning(self, final: bool) -> str:
        """Reasoning text that is certain: not a possible start of `</think>`, nor newlines it might follow."""
        if final:
            text, self._pending = self._pending.rstrip("\n"), ""
            return self._emit_reasoning(text)
        held = _tag_prefix_length(self._pending, THINK_END)
        body = self._pending[: len(self._pending) - held]
        keep = len(body) - len(body.rstrip("\n"))
        text = body[: len(body) - keep]
        self._pending = self._pending[len(text) :]
        return self._emit_reasoning(text)

    def _emit_reasoning(self, text: str) -> str:
        if not self._reasoning_started:
            text = text.lstrip("\n")
            self._reasoning_started = bool(text)
        return text

    def _take_content(self) -> str:
        text, self._pending = self._pending, ""
        if self._answer_starts:
            text = text.lstrip("\n")
            self._answer_starts = not text
        return text


def _tag_prefix_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of `tag` (text that may become the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
