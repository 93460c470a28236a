"""/v1/completions: prompt(s) -> generation -> the response, or a stream of the same object, one choice delta each.

`prompt` may be a string, a list of strings, a list of token ids or a list of token-id lists; each prompt gets
n choices, numbered prompt by prompt. vLLM's `structured_outputs` / `guided_*` constrain every choice.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from engine.core.request import TokenLogprob
from server.openai.choices import ChoiceState
from server.openai.errors import invalid_request
from server.openai.generation import Generation, ServingContext, is_batch, start_generation
from server.openai.logprobs import completion_logprobs, echoed_prompt_logprobs, joined
from server.openai.schemas import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from server.tokens import Tokenizer

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for completions (chat's is the whole context)."""


async def serve_completion(ctx: ServingContext, body: CompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    lora = ctx.check_request(body)
    prompts = _prompts(body, ctx.tokenizer)
    echo = _Echo(body, prompts, ctx.tokenizer) if body.echo else None
    generation = await start_generation(
        ctx,
        f"cmpl-{uuid.uuid4().hex}",
        prompts,
        body,
        body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS,
        logprobs=body.logprobs is not None,
        top_logprobs=body.logprobs or 0,
        param="prompt",
        arrival=arrival,
        constraint=body.vllm_constraint(),
        lora=lora,
        batch=is_batch(request),
    )
    if body.stream:
        return generation.stream_response(CompletionResponse, _chunk_choices(generation, body, ctx.tokenizer, echo))
    return await generation.json_response(
        request, CompletionResponse, lambda choice: _final_choice(choice, body, ctx.tokenizer, echo)
    )


class _Echo:
    """`echo`: each choice's text starts with its prompt (and, with logprobs, the prompt's tokens are scored)."""

    def __init__(self, body: CompletionRequest, prompts: list[list[int]], tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.num_choices = body.num_choices
        self.prompts = prompts
        # A text prompt comes back as the client wrote it; token ids as their text.
        if isinstance(body.prompt, str):
            self.texts = [body.prompt]
        elif isinstance(body.prompt[0], str):
            self.texts = list(body.prompt)  # type: ignore[arg-type]
        else:
            self.texts = [tokenizer.decode(ids) for ids in prompts]
        self.logprobs = body.logprobs is not None

    def text(self, choice_index: int) -> str:
        return self.texts[choice_index // self.num_choices]

    def prompt_logprobs(self, choice_index: int, scored: list[TokenLogprob]) -> CompletionLogprobs:
        return echoed_prompt_logprobs(self.tokenizer, self.prompts[choice_index // self.num_choices], scored)


def _prompts(body: CompletionRequest, tokenizer: Tokenizer) -> list[list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if not prompt:
        raise invalid_request("'prompt' must not be empty.", "prompt")
    if isinstance(prompt[0], str):
        return [tokenizer.encode(text) for text in prompt]  # type: ignore[arg-type]
    if isinstance(prompt[0], int):
        return [_checked_token_ids(prompt, tokenizer)]  # type: ignore[arg-type]
    return [_checked_token_ids(ids, tokenizer) for ids in prompt]  # type: ignore[arg-type]


def _checked_token_ids(ids: list[int], tokenizer: Tokenizer) -> list[int]:
    vocab_size = tokenizer.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise invalid_request(f"Token id {bad} is outside the vocabulary [0, {vocab_size}).", "prompt")
    return ids


def _final_choice(
    choice: ChoiceState, body: CompletionRequest, tokenizer: Tokenizer, echo: _Echo | None
) -> CompletionChoice:
    prefix = echo.text(choice.index) if echo is not None else ""
    logprobs = None
    if body.logprobs is not None:
        logprobs = completion_logprobs(tokenizer, choice.logprobs, len(prefix))
        if echo is not None:
            logprobs = joined(echo.prompt_logprobs(choice.index, choice.prompt_logprobs), logprobs)
    return CompletionChoice(
        index=choice.index,
        text=prefix + choice.full_text,
        logprobs=logprobs,
        finish_reason=choice.finish_reason,  # type: ignore[arg-type]
    )


async def _chunk_choices(
    generation: Generation, body: CompletionRequest, tokenizer: Tokenizer, echo: _Echo | None
) -> AsyncIterator[list[CompletionChoice]]:
    # Where each choice's next logprob token starts in its text (completions report text offsets).
    offsets = [0] * len(generation.choices)
    # An echoed prompt goes out in the choice's first chunk; its logprobs arrive with the prefill steps, which
    # all come before (or with) the first generated token.
    unechoed = set(range(len(generation.choices))) if echo is not None else set()
    scored_prompts: dict[int, list[TokenLogprob]] = {}
    async for index, update in generation.updates():
        scored_prompts.setdefault(index, []).extend(update.prompt_logprobs)
        if not (update.text or update.logprobs or update.finish_reason):
            continue
        if echo is not None and index in unechoed:
            unechoed.discard(index)
            text = echo.text(index)
            prompt_logprobs = echo.prompt_logprobs(index, scored_prompts.pop(index)) if echo.logprobs else None
            offsets[index] = len(text)
            yield [CompletionChoice(index=index, text=text, logprobs=prompt_logprobs, finish_reason=None)]
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(tokenizer, update.logprobs, offsets[index])
            offsets[index] += sum(len(token) for token in logprobs.tokens)
        yield [
            CompletionChoice(
                index=index,
                text=update.text,
                logprobs=logprobs,
                finish_reason=update.finish_reason,  # type: ignore[arg-type]
            )
        ]
