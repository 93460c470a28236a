"""/v1/chat/completions: messages (and tools) -> prompt (the model's chat template) -> generation -> the response
or its chunks.

A stream opens each choice with a role chunk, sends its text (and logprobs) as content deltas and its tool calls
as `tool_calls` deltas (id and name first, then the arguments in pieces), and closes it with an empty delta
carrying the finish reason, as OpenAI does. With a reasoning parser, the model's reasoning goes to
`reasoning_content` (whole, or as deltas of it), never into `content` nor into tool-call parsing. A constrained
answer (response_format, an enforced tool call) is grammar-bound from its first token, so it has no reasoning to
split off.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from engine.multimodal.inputs import ImageInput
from server.openai.choices import ChoiceState
from server.openai.generation import Generation, ServingContext, is_batch, start_generation
from server.openai.images import ImageRef
from server.openai.logprobs import chat_logprobs
from server.openai.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    FunctionCall,
    FunctionCallChunk,
    ToolCall,
    ToolCallChunk,
)
from server.openai.template import EFFORT_VARIABLE, render_conversation
from server.openai.tool_parsers.base import ToolCallDelta
from server.tokens import Tokenizer


async def serve_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    lora = ctx.check_request(body)
    answer = body.output_constraint()
    image_refs: list[ImageRef] = []
    messages = body.template_messages(image_refs)
    ctx.check_images(image_refs)
    images: tuple[ImageInput, ...] = ()
    if ctx.harmony is not None:
        tools = ctx.harmony.offered_tools(body.function_tools(), body.tool_choice_value())
        constraint = ctx.harmony.constraint(tools, body.tool_choice_value(), answer)
        effort = body.template_kwargs(ctx.template_options).get(EFFORT_VARIABLE)
        prompt = ctx.harmony.render(messages, tools, effort, "messages")
        harmony = dataclasses.replace(ctx.harmony, calls=bool(tools))
        tool_use = splitter = None
    else:
        harmony = None
        tool_use = ctx.tool_use(body.function_tools(), body.tool_choice_value(), body.parallel_tool_calls)
        constraint = tool_use.constraint(answer) if tool_use else answer
        prompt_text = render_conversation(
            ctx.tokenizer,
            messages,
            body.template_kwargs(ctx.tokenizer.chat_template_options),
            tool_use.template_tools() if tool_use else None,
            "messages",
        )
        prompt, images = await ctx.prompt_ids(prompt_text, image_refs, "messages")
        reasoning = ctx.reasoning if constraint is None else None
        splitter = None if reasoning is None else functools.partial(reasoning.splitter, prompt_text)
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
        constraint=constraint,
        reasoning_splitter=splitter,
        tool_reader=tool_use.reader_factory() if tool_use else None,
        prediction=None
        if body.prediction is None
        else ctx.tokenizer.encode(body.prediction.text(), add_special_tokens=False),
        lora=lora,
        batch=is_batch(request),
        harmony=harmony,
        images=images,
    )
    if body.stream:
        return generation.stream_response(ChatCompletionChunk, _chunk_choices(generation, body, ctx.tokenizer))
    return await generation.json_response(
        request, ChatCompletionResponse, lambda choice: _final_choice(choice, body, ctx.tokenizer)
    )


def _final_choice(choice: ChoiceState, body: ChatCompletionRequest, tokenizer: Tokenizer) -> ChatChoice:
    calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in choice.tool_calls]
    content = choice.full_text
    return ChatChoice(
        index=choice.index,
        # An answer that only calls tools has no content, as OpenAI's (null, not the layout around the calls).
        message=ChatResponseMessage(
            content=None if calls and not content.strip() else content,
            reasoning_content=choice.full_reasoning or None,
            tool_calls=calls or None,
        ),
        logprobs=chat_logprobs(tokenizer, choice.logprobs) if body.logprobs else None,
        finish_reason=choice.finish_reason,  # type: ignore[arg-type]
    )


async def _chunk_choices(
    generation: Generation, body: ChatCompletionRequest, tokenizer: Tokenizer
) -> AsyncIterator[list[ChatChunkChoice]]:
    for choice in generation.choices:
        yield [ChatChunkChoice(index=choice.index, delta=ChatDelta(role="assistant", content=""))]
    async for index, update in generation.updates():
        logprobs = chat_logprobs(tokenizer, update.logprobs) if body.logprobs and update.logprobs else None
        if update.text or update.reasoning or (logprobs is not None and not update.tool_calls):
            # Reasoning alone leaves `content` out of the delta; otherwise it is there, if only "".
            content = update.text if update.text or not update.reasoning else None
            delta = ChatDelta(content=content, reasoning_content=update.reasoning or None)
            yield [ChatChunkChoice(index=index, delta=delta, logprobs=logprobs)]
            logprobs = None
        for call in update.tool_calls:
            # The tokens that wrote a call travel with its first chunk of this update, as vLLM sends them.
            yield [ChatChunkChoice(index=index, delta=ChatDelta(tool_calls=[_call_chunk(call)]), logprobs=logprobs)]
            logprobs = None
        if update.finish_reason is not None:
            yield [ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=update.finish_reason)]


def _call_chunk(delta: ToolCallDelta) -> ToolCallChunk:
    if delta.id is None:
        return ToolCallChunk(index=delta.index, function=FunctionCallChunk(arguments=delta.arguments))
    return ToolCallChunk(
        index=delta.index,
        id=delta.id,
        type="function",
        function=FunctionCallChunk(name=delta.name, arguments=delta.arguments),
    )
