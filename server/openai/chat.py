"""/v1/chat/completions: messages -> prompt (the model's chat template) -> generation -> the response or its chunks.

A stream opens each choice with a role chunk, sends its text (and logprobs) as content deltas, and closes it
with an empty delta carrying the finish reason, as OpenAI does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from server.openai.choices import ChoiceState
from server.openai.errors import invalid_request
from server.openai.generation import Generation, ServingContext, start_generation
from server.openai.logprobs import chat_logprobs
from server.openai.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
)
from server.tokens import ChatTemplateError, Tokenizer


async def serve_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    ctx.check_request(body)
    messages = body.template_messages()
    try:
        prompt = ctx.tokenizer.apply_chat_template(messages)
    except ChatTemplateError as exc:
        raise invalid_request(str(exc), "messages") from exc
    generation = await start_generation(
        ctx,
        f"chatcmpl-{uuid.uuid4().hex}",
        [prompt],
        body,
        body.requested_max_tokens,
        logprobs=bool(body.logprobs),
        top_logprobs=body.top_logprobs or 0,
        param="messages",
        arrival=arrival,
    )
    if body.stream:
        return generation.stream_response(ChatCompletionChunk, _chunk_choices(generation, body, ctx.tokenizer))
    return await generation.json_response(
        request, ChatCompletionResponse, lambda choice: _final_choice(choice, body, ctx.tokenizer)
    )


def _final_choice(choice: ChoiceState, body: ChatCompletionRequest, tokenizer: Tokenizer) -> ChatChoice:
    return ChatChoice(
        index=choice.index,
        message=ChatResponseMessage(content=choice.full_text),
        logprobs=chat_logprobs(tokenizer, choice.logprobs) if body.logprobs else None,
        finish_reason=choice.finish_reason,  # type: ignore[arg-type]
    )


async def _chunk_choices(
    generation: Generation, body: ChatCompletionRequest, tokenizer: Tokenizer
) -> AsyncIterator[list[ChatChunkChoice]]:
    for choice in generation.choices:
        yield [ChatChunkChoice(index=choice.index, delta=ChatDelta(role="assistant", content=""))]
    async for index, update in generation.updates():
        if update.text or update.logprobs:
            logprobs = chat_logprobs(tokenizer, update.logprobs) if body.logprobs else None
            yield [ChatChunkChoice(index=index, delta=ChatDelta(content=update.text), logprobs=logprobs)]
        if update.finish_reason is not None:
            yield [ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=update.finish_reason)]
