"""One choice of a response: engine deltas in, text deltas out, with stop strings cut and counted tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.request import FinishReason, StepOutput, TokenLogprob
from server.openai.errors import engine_failure
from server.tokens import StopStringMatcher, Tokenizer


@dataclass(slots=True)
class ChoiceUpdate:
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    prompt_logprobs: list[TokenLogprob]
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
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    """Kept like `logprobs`, for an echoed prompt."""
    num_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self._detokenizer = self.tokenizer.detokenizer(self.prompt_ids)
        self._stop = StopStringMatcher(self.stop)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def consume(self, output: StepOutput) -> ChoiceUpdate:
        """Fold one engine delta in; a stop string sets finish_reason "stop" (the caller aborts the request)."""
        if output.finish_reason is FinishReason.ABORT:
            # We never see our own aborts (their requests are unrouted first), so this one is the engine's.
            raise engine_failure(output.error or "The engine aborted the request.")
        self.num_tokens += len(output.new_token_ids)
        self.num_cached_tokens = output.num_cached_tokens
        new_logprobs = output.new_logprobs or []
        prompt_logprobs = output.new_prompt_logprobs or []
        if self.keep_logprobs:
            self.logprobs.extend(new_logprobs)
            self.prompt_logprobs.extend(prompt_logprobs)
        text = self._detokenizer.push(output.new_token_ids)
        if output.finished:
            text += self._detokenizer.flush()
        emitted, stopped = self._stop.feed(text)
        if stopped:
            self.finish_reason = "stop"
        elif output.finish_reason is not None:
            emitted += self._stop.flush()
            self.finish_reason = output.finish_reason.value
        self.text.append(emitted)
        return ChoiceUpdate(emitted, new_logprobs, self.finish_reason, prompt_logprobs)

    @property
    def full_text(self) -> str:
        return "".join(self.text)
