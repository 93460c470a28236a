"""/v1/chat/completions: messages -> prompt (the model's chat template) -> generation -> the response or its chunks.

A stream opens each choice with a role chunk, sends its text (and logprobs) as content deltas, and closes it
with an empty delta carrying the finish reason, as OpenAI does. With a reasoning parser, the model's reasoning
goes to `reasoning_content` (whole, or as deltas of it), never into `content`.
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
        prompt_text = ctx.tokenizer.render_chat_template(
            messages, body.template_kwargs(ctx.tokenizer.chat_template_options)
        )
    except ChatTemplateError as exc:
        raise invalid_request(str(exc), "messages") from exc
    reasoning = ctx.reasoning
    generation = await start_generation(
        ctx,
        f"chatcmpl-{uuid.uuid4().hex}",
        [ctx.tokenizer.encode_rendered(prompt_text)],
        body,
        body.requested_max_tokens,
        logprobs=bool(body.logprobs),
        top_logprobs=body.top_logprobs or 0,
        param="messages",
        arrival=arrival,
        reasoning_splitter=None if reasoning is None else lambda: reasoning.splitter(prompt_text),
    )
    if body.stream:
        return generation.stream_response(ChatCompletionChunk, _chunk_choices(generation, body, ctx.tokenizer))
    return await generation.json_response(
        request, ChatCompletionResponse, lambda choice: _final_choice(choice, body, ctx.tokenizer)
    )


def _final_choice(choice: ChoiceState, body: ChatCompletionRequest, tokenizer: Tokenizer) -> ChatChoice:
    return ChatChoice(
        index=choice.index,
        message=ChatResponseMessage(content=choice.full_text, reasoning_content=choice.full_reasoning or None),
        logprobs=chat_logprobs(tokenizer, choice.logprobs) if body.logprobs else None,
        finish_reason=choice.finish_reason,  # type: ignore[arg-type]
    )


async def _chunk_choices(
    generation: Generation, body: ChatCompletionRequest, tokenizer: Tokenizer
) -> AsyncIterator[list[ChatChunkChoice]]:
    for choice in generation.choices:
        yield [ChatChunkChoice(index=choice.index, delta=ChatDelta(role="assistant", content=""))]
    async for index, update in generation.updates():
        if update.text or update.reasoning or update.logprobs:
            logprobs = chat_logprobs(tokenizer, update.logprobs) if body.logprobs else None
            # Reasoning alone leaves `content` out of the delta; otherwise it is there, if only "".
            content = update.text if update.text or not update.reasoning else None
            delta = ChatDelta(content=content, reasoning_content=update.reasoning or None)
            yield [ChatChunkChoice(index=index, delta=delta, logprobs=logprobs)]
        if update.finish_reason is not None:
            yield [ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=update.finish_reason)]
