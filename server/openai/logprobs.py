"""The engine's TokenLogprob lists in OpenAI's two shapes: chat's `content` list and completions' columns."""

from __future__ import annotations

from collections.abc import Sequence

from engine.core.request import TokenLogprob
from server.openai.schemas import ChatChoiceLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from server.tokens import Tokenizer

# JSON has no -infinity; OpenAI reports impossible tokens with this floor instead.
LOGPROB_FLOOR = -9999.0


def _clamp(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def chat_logprobs(tokenizer: Tokenizer, logprobs: Sequence[TokenLogprob]) -> ChatChoiceLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        text = tokenizer.token_text(token_id)
        return TopLogprob(token=text, logprob=_clamp(logprob), bytes=list(text.encode()))

    content = []
    for entry in logprobs:
        chosen = top(entry.token_id, entry.logprob)
        alternatives = [top(token_id, logprob) for token_id, logprob in entry.top]
        content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=alternatives))
    return ChatChoiceLogprobs(content=content)


def completion_logprobs(tokenizer: Tokenizer, logprobs: Sequence[TokenLogprob], text_offset: int) -> CompletionLogprobs:
    """`text_offset` is where the first of these tokens starts in the choice's text."""
    tokens, offsets = [], []
    for entry in logprobs:
        text = tokenizer.token_text(entry.token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[_clamp(entry.logprob) for entry in logprobs],
        top_logprobs=[{tokenizer.token_text(t): _clamp(lp) for t, lp in entry.top} for entry in logprobs],
        text_offset=offsets,
    )


def echoed_prompt_logprobs(
    tokenizer: Tokenizer, prompt_ids: Sequence[int], scored: Sequence[TokenLogprob] | None
) -> CompletionLogprobs:
    """An echoed prompt's tokens in completions' columns: nothing precedes the first, so it has no logprob.

    `scored` is the engine's entries for the tokens after the first; None when logprobs were not asked for.
    """
    first = tokenizer.token_text(prompt_ids[0])
    rest = completion_logprobs(tokenizer, scored or [], len(first))
    return CompletionLogprobs(
        tokens=[first, *rest.tokens],
        token_logprobs=[None, *rest.token_logprobs],
        top_logprobs=[None, *(rest.top_logprobs or [])],
        text_offset=[0, *rest.text_offset],
    )


def joined(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=first.tokens + then.tokens,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        top_logprobs=(first.top_logprobs or []) + (then.top_logprobs or []),
        text_offset=first.text_offset + then.text_offset,
    )
