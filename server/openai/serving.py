"""The work behind /v1/chat/completions and /v1/completions: prompt -> engine requests -> response or stream.

A request becomes n engine requests per prompt (same prompt ids, so the prefix cache can share its pages;
choice i seeded with seed + i). Admission is awaited before any byte is sent, so a full queue is a 429 and a
too-long prompt a 400 even for a stream. After that, every engine delta goes through the choice's
detokenizer and stop-string matcher; errors after the first streamed byte become an SSE error event.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from engine.driver import EngineRequest
from engine.request import QueueFull, RequestRejected, StepOutput
from server.client import EngineAddFailed, EngineClient, EngineDeadError, RequestGroup
from server.lifecycle import Lifecycle
from server.metrics import RequestTimer, ServerMetrics, rejection_reason
from server.openai.choices import ChoiceState, ChoiceUpdate
from server.openai.errors import APIError, engine_failure, invalid_request
from server.openai.logprobs import chat_logprobs, completion_logprobs
from server.openai.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    SamplingRequest,
    Usage,
)
from server.sse import SSE_DONE, SSEResponse, sse_data
from server.tokens import ChatTemplateError, Tokenizer

logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1
"""Suggested back-off after a 429: the waiting queue moves on within a few engine steps."""


@dataclass
class ServingContext:
    client: EngineClient
    tokenizer: Tokenizer
    metrics: ServerMetrics
    lifecycle: Lifecycle
    model_name: str
    """The name clients must send as `model`."""
    max_model_len: int
    request_timeout: float | None


class Generation:
    """One API call in flight: its engine requests, its choices, its deadline, and its cleanup."""

    def __init__(
        self,
        ctx: ServingContext,
        response_id: str,
        prompts: list[list[int]],
        num_choices: int,
        group: RequestGroup,
        choices: list[ChoiceState],
        arrival: float,
    ) -> None:
        self.ctx = ctx
        self.id = response_id
        self.created = int(time.time())
        self.prompts = prompts
        self.num_choices = num_choices
        self.group = group
        self.choices = choices
        self.timers = [RequestTimer(ctx.metrics, arrival) for _ in choices]
        self._unfinished = len(choices)
        self._deadline: asyncio.TimerHandle | None = None
        self._closed = False
        ctx.lifecycle.request_started()
        if ctx.request_timeout:
            remaining = max(0.0, arrival + ctx.request_timeout - time.monotonic())
            timeout = APIError(
                504,
                f"The request did not finish within the server's request timeout ({ctx.request_timeout:g}s).",
                type="timeout_error",
                code="request_timeout",
            )
            self._deadline = asyncio.get_running_loop().call_later(remaining, group.fail, timeout)

    @property
    def done(self) -> bool:
        return self._unfinished == 0

    async def admitted(self) -> None:
        """Wait until the engine took every request; map its refusal to the API's error."""
        try:
            await self.group.wait_admitted()
        except QueueFull as exc:
            raise APIError(
                429,
                f"The server's request queue is full ({exc}); retry after {RETRY_AFTER_SECONDS}s.",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            ) from exc
        except RequestRejected as exc:
            raise invalid_request(str(exc), code=exc.code) from exc
        except (EngineDeadError, EngineAddFailed) as exc:
            raise engine_failure(str(exc)) from exc
        for prompt in self.prompts:
            self.ctx.metrics.prompt_tokens.inc(len(prompt) * self.num_choices)

    async def next_update(self) -> tuple[int, ChoiceUpdate | None]:
        """The next engine delta, folded into its choice; None for leftovers of a choice already finished."""
        try:
            index, output, received = await self.group.get()
        except EngineDeadError as exc:
            raise engine_failure(str(exc)) from exc
        return index, self._apply(index, output, received)

    def _apply(self, index: int, output: StepOutput, received: float) -> ChoiceUpdate | None:
        choice = self.choices[index]
        if choice.finished:
            return None
        update = choice.consume(output)
        timer = self.timers[index]
        timer.on_output(received, len(output.new_token_ids), output.queue_seconds)
        if update.finish_reason is not None:
            if not output.finished:
                self.group.abort(index)  # a stop string ended it before the engine would have
            timer.on_finish(received, update.finish_reason)
            self._unfinished -= 1
        return update

    def usage(self) -> Usage:
        """OpenAI counts a prompt once however many choices share it; cached tokens likewise."""
        n = self.num_choices
        cached = sum(
            max(c.num_cached_tokens for c in self.choices[p * n : (p + 1) * n]) for p in range(len(self.prompts))
        )
        prompt_tokens = sum(len(p) for p in self.prompts)
        completion_tokens = sum(c.num_tokens for c in self.choices)
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    def close(self) -> None:
        """Abort what still runs and release everything; idempotent, called however the response ended."""
        if self._closed:
            return
        self._closed = True
        if self._deadline is not None:
            self._deadline.cancel()
        self.group.close()
        self.ctx.lifecycle.request_finished()


class OpenAIServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    # ------------------------------------------------------------------ chat

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        self.ctx.lifecycle.check_accepting()
        self._check_model(body.model)
        body.check_supported()
        messages = body.template_messages()
        try:
            prompt = self.ctx.tokenizer.apply_chat_template(messages)
        except ChatTemplateError as exc:
            raise invalid_request(str(exc), "messages") from exc
        generation = await self._start(
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
            return SSEResponse(self._chat_events(generation, body), on_close=generation.close)
        return await _unless_disconnected(request, self._chat_response(generation, body), generation)

    async def _chat_response(self, generation: Generation, body: ChatCompletionRequest) -> Response:
        while not generation.done:
            await generation.next_update()
        tokenizer = self.ctx.tokenizer
        response = ChatCompletionResponse(
            id=generation.id,
            created=generation.created,
            model=self.ctx.model_name,
            choices=[
                ChatChoice(
                    index=choice.index,
                    message=ChatResponseMessage(content=choice.full_text),
                    logprobs=chat_logprobs(tokenizer, choice.logprobs) if body.logprobs else None,
                    finish_reason=choice.finish_reason,  # type: ignore[arg-type]
                )
                for choice in generation.choices
            ],
            usage=generation.usage(),
        )
        return Response(response.model_dump_json(), media_type="application/json")

    async def _chat_events(self, generation: Generation, body: ChatCompletionRequest) -> AsyncIterator[bytes]:
        exclude = None if body.include_usage else {"usage"}

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
            event = ChatCompletionChunk(
                id=generation.id, created=generation.created, model=self.ctx.model_name, choices=choices, usage=usage
            )
            return sse_data(event.model_dump_json(exclude=exclude))

        async def events() -> AsyncIterator[bytes]:
            for choice in generation.choices:
                yield chunk([ChatChunkChoice(index=choice.index, delta=ChatDelta(role="assistant", content=""))])
            while not generation.done:
                index, update = await generation.next_update()
                if update is None:
                    continue
                if update.text or update.logprobs:
                    logprobs = chat_logprobs(self.ctx.tokenizer, update.logprobs) if body.logprobs else None
                    delta = ChatDelta(content=update.text)
                    yield chunk([ChatChunkChoice(index=index, delta=delta, logprobs=logprobs)])
                if update.finish_reason is not None:
                    finish = ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=update.finish_reason)
                    yield chunk([finish])
            if body.include_usage:
                yield chunk([], generation.usage())

        async for event in self._with_error_event(events()):
            yield event

    # ------------------------------------------------------------------ completions

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        self.ctx.lifecycle.check_accepting()
        self._check_model(body.model)
        body.check_supported()
        generation = await self._start(
            f"cmpl-{uuid.uuid4().hex}",
            self._completion_prompts(body),
            body,
            body.max_tokens if body.max_tokens is not None else 16,
            logprobs=body.logprobs is not None,
            top_logprobs=body.logprobs or 0,
            param="prompt",
            arrival=arrival,
        )
        if body.stream:
            return SSEResponse(self._completion_events(generation, body), on_close=generation.close)
        return await _unless_disconnected(request, self._completion_response(generation, body), generation)

    def _completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, str):
            return [self.ctx.tokenizer.encode(prompt)]
        if not prompt:
            raise invalid_request("'prompt' must not be empty.", "prompt")
        if isinstance(prompt[0], str):
            return [self.ctx.tokenizer.encode(text) for text in prompt]  # type: ignore[arg-type]
        if isinstance(prompt[0], int):
            return [self._check_token_ids(prompt)]  # type: ignore[arg-type]
        return [self._check_token_ids(ids) for ids in prompt]  # type: ignore[arg-type]

    def _check_token_ids(self, ids: list[int]) -> list[int]:
        vocab_size = self.ctx.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise invalid_request(f"Token id {bad} is outside the vocabulary [0, {vocab_size}).", "prompt")
        return ids

    async def _completion_response(self, generation: Generation, body: CompletionRequest) -> Response:
        while not generation.done:
            await generation.next_update()
        tokenizer = self.ctx.tokenizer
        response = CompletionResponse(
            id=generation.id,
            created=generation.created,
            model=self.ctx.model_name,
            choices=[
                CompletionChoice(
                    index=choice.index,
                    text=choice.full_text,
                    logprobs=completion_logprobs(tokenizer, choice.logprobs, 0) if body.logprobs is not None else None,
                    finish_reason=choice.finish_reason,  # type: ignore[arg-type]
                )
                for choice in generation.choices
            ],
            usage=generation.usage(),
        )
        return Response(response.model_dump_json(), media_type="application/json")

    async def _completion_events(self, generation: Generation, body: CompletionRequest) -> AsyncIterator[bytes]:
        exclude = None if body.include_usage else {"usage"}
        # Where each choice's next logprob token starts in its text (completions report text offsets).
        offsets = [0] * len(generation.choices)

        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> bytes:
            event = CompletionResponse(
                id=generation.id, created=generation.created, model=self.ctx.model_name, choices=choices, usage=usage
            )
            return sse_data(event.model_dump_json(exclude=exclude))

        async def events() -> AsyncIterator[bytes]:
            while not generation.done:
                index, update = await generation.next_update()
                if update is None or not (update.text or update.logprobs or update.finish_reason):
                    continue
                logprobs = None
                if body.logprobs is not None:
                    logprobs = completion_logprobs(self.ctx.tokenizer, update.logprobs, offsets[index])
                    offsets[index] += sum(len(token) for token in logprobs.tokens)
                yield chunk(
                    [
                        CompletionChoice(
                            index=index,
                            text=update.text,
                            logprobs=logprobs,
                            finish_reason=update.finish_reason,  # type: ignore[arg-type]
                        )
                    ]
                )
            if body.include_usage:
                yield chunk([], generation.usage())

        async for event in self._with_error_event(events()):
            yield event

    # ------------------------------------------------------------------ shared

    def _check_model(self, model: str) -> None:
        if model != self.ctx.model_name:
            raise APIError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")

    async def _start(
        self,
        response_id: str,
        prompts: list[list[int]],
        body: SamplingRequest,
        max_tokens: int | None,
        *,
        logprobs: bool,
        top_logprobs: int,
        param: str,
        arrival: float,
    ) -> Generation:
        """Validate lengths, submit every choice's engine request, and wait until the engine took them all."""
        ctx = self.ctx
        n = body.num_choices
        requests: list[EngineRequest] = []
        choices: list[ChoiceState] = []
        for p, prompt in enumerate(prompts):
            max_new_tokens = self._max_new_tokens(prompt, max_tokens, param)
            for i in range(n):
                params = body.sampling_params(
                    max_new_tokens=max_new_tokens, choice_index=i, logprobs=logprobs, top_logprobs=top_logprobs
                )
                requests.append(EngineRequest(f"{response_id}-{p}-{i}", prompt, params))
                choices.append(
                    ChoiceState(
                        index=p * n + i,
                        tokenizer=ctx.tokenizer,
                        prompt_ids=prompt,
                        stop=body.stop_strings,
                        keep_logprobs=logprobs and not body.stream,
                    )
                )
        try:
            group = ctx.client.submit(requests)
        except EngineDeadError as exc:
            raise APIError(503, str(exc), type="service_unavailable_error", code="engine_dead") from exc
        generation = Generation(ctx, response_id, prompts, n, group, choices, arrival)
        try:
            await generation.admitted()
        except BaseException:
            generation.close()
            raise
        return generation

    def _max_new_tokens(self, prompt: Sequence[int], requested: int | None, param: str) -> int:
        limit = self.ctx.max_model_len
        if not prompt:
            raise invalid_request(f"'{param}' must not be empty.", param)
        if requested is None and len(prompt) < limit:
            return limit - len(prompt)
        wanted = len(prompt) + (requested or 1)
        if wanted > limit:
            raise invalid_request(
                f"This model's maximum context length is {limit} tokens. However, you requested {wanted} tokens "
                f"({len(prompt)} in the {param}, {wanted - len(prompt)} in the completion). "
                f"Please reduce the length of the {param} or completion.",
                param,
                code="context_length_exceeded",
            )
        assert requested is not None
        return requested

    async def _with_error_event(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """Pass the events through; an error after the first byte becomes `data: {"error": ...}`; then [DONE]."""
        try:
            async for event in events:
                yield event
        except APIError as exc:
            reason = rejection_reason(exc.status_code)
            if reason is not None:
                self.ctx.metrics.count_rejection(reason)
            yield sse_data(exc.json())
        except Exception:
            logger.exception("Stream failed")
            yield sse_data(APIError(500, "Internal server error.", type="server_error", code="internal_error").json())
        yield SSE_DONE


async def _unless_disconnected(
    request: Request, work: Coroutine[Any, Any, Response], generation: Generation
) -> Response:
    """Run a non-streaming response's work, abandoning it (and its engine requests) if the client leaves."""
    work_task = asyncio.ensure_future(work)
    disconnect_task = asyncio.ensure_future(_client_disconnected(request))
    try:
        await asyncio.wait({work_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED)
        if work_task.done():
            return work_task.result()
        return Response(status_code=499)  # nobody is listening; the status only shows in the access log
    finally:
        for task in (work_task, disconnect_task):
            task.cancel()
        generation.close()


async def _client_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
