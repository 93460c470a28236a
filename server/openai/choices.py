"""One choice of a response: engine deltas in, text, reasoning and tool-call deltas out, with stop strings cut and
counted tokens.

The text goes through three stages in order: stop strings (on all of it), the reasoning splitter (with a reasoning
parser), then the tool-call reader, which sees only the answer: a call the model writes while it reasons is not
a call. Under gpt-oss's Harmony format the tokens go to its reader instead (server/openai/harmony.py), which splits
them by channel; stop strings then apply to the answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.core.request import FinishReason, StepOutput, TokenLogprob
from server.openai.errors import engine_failure
from server.openai.harmony import HarmonyReader
from server.openai.tool_parsers.base import ParsedCall, ToolCallDelta, ToolCallReader
from server.reasoning import MARKER_TOKENS as REASONING_MARKERS
from server.reasoning import ReasoningSplitter
from server.tokens import StopStringMatcher, Tokenizer


@dataclass(slots=True)
class ChoiceUpdate:
    text: str
    """The answer's new text (all of the new text without a reasoning parser or tool reader)."""
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    reasoning: str = ""
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    """Of prompt tokens (from the second on), for an echoed prompt with logprobs."""


@dataclass
class ChoiceState:
    """Streaming and non-streaming responses both go through this, so their texts agree by construction."""

    index: int
    tokenizer: Tokenizer
    prompt_ids: Sequence[int]
    stop: Sequence[str]
    keep_logprobs: bool = False
    """Accumulate logprobs for a non-streaming response (a stream sends them with each delta instead)."""
    reasoning_splitter: ReasoningSplitter | None = None
    """Splits the text after stop strings into reasoning and answer; None leaves it all answer."""
    tool_reader: ToolCallReader | None = None
    """Splits the answer into content and tool calls; None: it is all content."""
    harmony: HarmonyReader | None = None
    """Reads a Harmony reply's tokens into reasoning, answer and calls, in place of the three stages."""
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    num_reasoning_tokens: int = 0
    """Output tokens up to and including the one that closed the reasoning (all of them while it is open)."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    """Kept like `logprobs`, for an echoed prompt."""
    tool_calls: list[ParsedCall] = field(default_factory=list)
    num_tokens: int = 0
    num_cached_tokens: int = 0
    prediction_tokens: tuple[int, int] = (0, 0)
    """With a prediction: its drafted tokens the model accepted and rejected so far."""
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        markers = self.tool_reader.marker_tokens if self.tool_reader is not None else ()
        if self.reasoning_splitter is not None:
            markers = (*markers, *REASONING_MARKERS)
        self._detokenizer = self.tokenizer.detokenizer(self.prompt_ids, keep_tokens=markers)
        self._stop = StopStringMatcher(self.stop)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def consume(self, output: StepOutput) -> ChoiceUpdate:
        """Fold one engine delta in; a stop string sets finish_reason "stop" (the caller aborts the request)."""
        if output.finish_reason is FinishReason.ABORT:
            # We never see our own aborts (their requests are unrouted first), so this one is the engine's.
            raise engine_failure(output.error or "The engine aborted the request.")
        if self.harmony is not None:
            return self._consume_harmony(output, self.harmony)
        emitted, stopped, num_used = self._text_until_stop(output.new_token_ids, output.finished)
        new_logprobs, prompt_logprobs = self._count(output, num_used)
        emitted, finish_reason = self._finish_reason(output, emitted, stopped)
        reasoning = ""
        if self.reasoning_splitter is not None:
            emitted, reasoning = self._split(emitted, num_used, finished=finish_reason is not None)
        calls: list[ToolCallDelta] = []
        if self.tool_reader is not None:
            read = self.tool_reader.feed(emitted)
            if finish_reason is not None:
                read.extend(self.tool_reader.finish())
            emitted, calls = read.content, read.calls
            self._collect(calls)
        if finish_reason == "stop" and self.tool_calls:
            finish_reason = "tool_calls"
        self.finish_reason = finish_reason
        self.text.append(emitted)
        self.reasoning.append(reasoning)
        return ChoiceUpdate(emitted, new_logprobs, finish_reason, calls, reasoning, prompt_logprobs)

    def _consume_harmony(self, output: StepOutput, reader: HarmonyReader) -> ChoiceUpdate:
        read = reader.feed(output.new_token_ids)
        content = read.content + (reader.finish() if output.finished else "")
        emitted, stopped = self._stop.feed(content)
        new_logprobs, _ = self._count(output, len(output.new_token_ids))
        self.num_reasoning_tokens += read.reasoning_tokens
        emitted, finish_reason = self._finish_reason(output, emitted, stopped)
        self._collect(read.calls)
        if finish_reason == "stop" and self.tool_calls:
            finish_reason = "tool_calls"
        self.finish_reason = finish_reason
        self.text.append(emitted)
        self.reasoning.append(read.reasoning)
        return ChoiceUpdate(emitted, new_logprobs, finish_reason, read.calls, read.reasoning)

    def _count(self, output: StepOutput, num_used: int) -> tuple[list[TokenLogprob], list[TokenLogprob]]:
        """Count the delta's first `num_used` tokens (those before a stop string); its (logprobs, prompt logprobs),
        kept for a non-streaming response."""
        self.num_tokens += num_used
        self.num_cached_tokens = output.num_cached_tokens
        if output.prediction_tokens is not None:
            self.prediction_tokens = output.prediction_tokens
        new_logprobs = (output.new_logprobs or [])[:num_used]
        prompt_logprobs = output.new_prompt_logprobs or []
        if self.keep_logprobs:
            self.logprobs.extend(new_logprobs)
            self.prompt_logprobs.extend(prompt_logprobs)
        return new_logprobs, prompt_logprobs

    def _finish_reason(self, output: StepOutput, emitted: str, stopped: bool) -> tuple[str, str | None]:
        """(the text to emit, the finish reason): "stop" for a stop string, else the engine's, with the text a
        stop string's prefix held back once the output is over."""
        if stopped:
            return emitted, "stop"
        if output.finish_reason is not None:
            return emitted + self._stop.flush(), output.finish_reason.value
        return emitted, None

    def _text_until_stop(self, tokens: Sequence[int], finished: bool) -> tuple[str, bool, int]:
        """(text safe to emit, whether a stop string ended it, tokens up to the one it ended in). A delta of
        several tokens goes in token by token when there are stop strings: the tokens after the one that completes
        a stop string were never generated as far as the client is concerned (text, logprobs, usage)."""
        if len(tokens) <= 1 or not self.stop:
            text = self._detokenizer.push(tokens) + (self._detokenizer.flush() if finished else "")
            return *self._stop.feed(text), len(tokens)
        parts = []
        for n, token in enumerate(tokens, 1):
            text = self._detokenizer.push([token])
            if finished and n == len(tokens):
                text += self._detokenizer.flush()
            part, stopped = self._stop.feed(text)
            parts.append(part)
            if stopped:
                return "".join(parts), True, n
        return "".join(parts), False, len(tokens)

    def _split(self, text: str, num_new_tokens: int, finished: bool) -> tuple[str, str]:
        """(answer, reasoning) of the new text."""
        splitter = self.reasoning_splitter
        assert splitter is not None
        was_reasoning = splitter.in_reasoning
        delta = splitter.feed(text)
        answer, reasoning = delta.content, delta.reasoning
        if finished:
            rest = splitter.flush()
            answer, reasoning = answer + rest.content, reasoning + rest.reasoning
        if was_reasoning or splitter.in_reasoning:
            self.num_reasoning_tokens += num_new_tokens
        return answer, reasoning

    def _collect(self, deltas: list[ToolCallDelta]) -> None:
        for delta in deltas:
            if delta.id is not None:
                self.tool_calls.append(ParsedCall(delta.id, delta.name or "", delta.arguments))
            else:
                self.tool_calls[delta.index].arguments += delta.arguments

    @property
    def full_text(self) -> str:
        return "".join(self.text)

    @property
    def full_reasoning(self) -> str:
        return "".join(self.reasoning)
