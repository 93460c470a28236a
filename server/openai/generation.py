"""What the generation endpoints share: one API call's engine requests, from admission to cleanup.

A request becomes n engine requests per prompt (same prompt ids, so the prefix cache can share its pages;
choice i seeded with seed + i). Admission is awaited before any byte is sent, so a full queue is a 429 and a
too-long prompt a 400 even for a stream. After that, every engine delta goes through the choice's
detokenizer, stop-string matcher, reasoning splitter and tool-call reader; errors after the first streamed byte
become the stream's error events. The endpoints (chat.py, completions.py, responses.py) differ in how they build
the prompts and what they make of the choices.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from engine.core.driver import EngineRequest
from engine.core.request import LoRARequest, QueueFull, RequestRejected, SamplingParams, StepOutput, StructuredOutput
from engine.multimodal.inputs import ImageInput
from engine.pooling.config import PoolingConfig
from server.client import EngineAddFailed, EngineClient, EngineDeadError, RequestGroup
from server.lifecycle import Lifecycle
from server.lora import LoRARegistry
from server.metrics import RequestTimer, ServerMetrics, rejection_reason
from server.openai.choices import ChoiceState, ChoiceUpdate
from server.openai.errors import APIError, engine_failure, internal_error, invalid_request
from server.openai.harmony import Harmony
from server.openai.images import ImagePrompts, ImageRef, no_images
from server.openai.schemas import CompletionTokensDetails, PromptTokensDetails, Usage
from server.openai.structured import Constraint, check_constraint
from server.openai.template import EFFORT_VARIABLE
from server.openai.tool_parsers.base import ToolCallReader
from server.openai.tools import ForcedFunction, FunctionTool, ToolChoiceMode, ToolUse, resolve_tool_use
from server.reasoning import ReasoningParser, ReasoningSplitter
from server.sse import SSE_DONE, SSEResponse, sse_data
from server.state.stored import StoredState
from server.tokens import Tokenizer

logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1
"""Suggested back-off after a 429: the waiting queue moves on within a few engine steps."""

BATCH_SCOPE_KEY = "ferry_batch"
"""The ASGI scope key that marks a call as a line of the Batch API (`True`): the batch runner calls the route
functions (serve_chat_completion and the like) with a request whose scope carries it, and their engine requests
are then batch requests, which the engine schedules behind every interactive one. An HTTP client cannot set a
scope key (a header of that name is no scope key), so no client's call can pass for a batch line."""


def is_batch(request: Request) -> bool:
    """Whether the call is a line of the Batch API (see `BATCH_SCOPE_KEY`)."""
    return request.scope.get(BATCH_SCOPE_KEY) is True


class GenerationRequest(Protocol):
    """What the generation core reads of an endpoint's request (chat, completions, responses)."""

    @property
    def model(self) -> str: ...

    @property
    def stream(self) -> bool | None: ...

    @property
    def num_choices(self) -> int: ...

    @property
    def stop_strings(self) -> list[str]: ...

    @property
    def include_usage(self) -> bool: ...

    @property
    def continuous_usage(self) -> bool: ...

    @property
    def priority(self) -> int: ...

    def check_supported(self, template_options: Collection[str] = ()) -> None: ...

    def sampling_params(
        self,
        *,
        max_new_tokens: int,
        choice_index: int,
        logprobs: bool,
        top_logprobs: int,
        structured_output: StructuredOutput | None = None,
    ) -> SamplingParams: ...


@dataclass
class ServingContext:
    client: EngineClient
    tokenizer: Tokenizer
    model_dir: str
    """Where the tokenizer came from: the engine's grammar compiler loads its vocabulary from there."""
    metrics: ServerMetrics
    lifecycle: Lifecycle
    model_names: tuple[str, ...]
    """The base model's names, which clients may send as `model`."""
    adapters: LoRARegistry
    """The LoRA adapters served now, whose names clients may send as `model` too."""
    max_model_len: int
    request_timeout: float | None
    sse_ping: float
    """Seconds between keep-alive pings on an open stream; 0 sends none."""
    reasoning: ReasoningParser | None
    """Splits chat answers from the model's reasoning; None for a model without (or told to use none)."""
    tool_call_parser: str | None = None
    """The parser that reads `tool_choice: auto` answers (server/openai/tool_parsers); None: no format known."""
    call_tags: tuple[str, str] | None = None
    """The text around a call object in the model's own format, where the grammar can write calls as the model
    does (tool_parsers/hermes.py call_tags); None: enforced calls use the JSON-array form."""
    pooling: PoolingConfig | None = None
    """What the model pools (embeddings, a cross-encoder's or a yes/no reranker's scores); None: it only
    generates."""
    max_batch_tokens: int = 0
    """Tokens one engine step computes (--max-batch-tokens): an encoder computes each input in one step."""
    max_queue_size: int = 0
    """Requests the engine keeps waiting at most (--max-queue-size; 0: no limit)."""
    reranker_template: str = ""
    """The prompt a yes/no reranker scores, `{query}` and `{document}` filled in (--reranker-template)."""
    stored: StoredState | None = None
    """Where stored responses are kept (server/state/); None: nothing is stored (an app without a database)."""
    harmony: Harmony | None = None
    """gpt-oss's chat format (server/harmony.py), which then renders conversations and reads replies instead of
    the chat template and the reasoning and tool-call parsers; None: the template's way."""
    images: ImagePrompts | None = None
    """An image model's prompts with images (server/openai/images.py); None: the model takes no images."""

    def check_images(self, refs: list[ImageRef]) -> None:
        """Refuse, by the first one's place, images sent to a model that takes none."""
        if self.images is None:
            no_images(refs)

    async def prompt_ids(self, text: str, refs: list[ImageRef], param: str) -> tuple[list[int], tuple[ImageInput, ...]]:
        """A rendered chat prompt's token ids and, where it holds images (`refs`, checked by `check_images`), each
        image's tokens in place and the images processed; `param` names the request field they came from."""
        if refs and self.images is not None:
            return await self.images.prompt(text, refs, param)
        return self.tokenizer.encode_rendered(text), ()

    @property
    def template_options(self) -> Collection[str]:
        """The variables a request may set for the rendering (`chat_template_kwargs`, the reasoning effort): the
        chat template's, or under Harmony the effort alone."""
        return (EFFORT_VARIABLE,) if self.harmony is not None else self.tokenizer.chat_template_options

    def tool_use(
        self,
        tools: Sequence[FunctionTool] | None,
        choice: ToolChoiceMode | ForcedFunction | None,
        parallel_tool_calls: bool | None,
        **params: str,
    ) -> ToolUse | None:
        """`resolve_tool_use` with what this server knows of the model's call format: its parser, its call tags,
        and whether `auto` may be strict (not for a model whose answers are split into reasoning)."""
        return resolve_tool_use(
            tools,
            choice,
            parallel_tool_calls,
            self.tool_call_parser,
            tags=self.call_tags,
            strict_auto=self.reasoning is None,
            **params,
        )

    @property
    def model_name(self) -> str:
        """The name responses report (the first served name, as vLLM does)."""
        return self.model_names[0]

    def check_model(self, model: str) -> LoRARequest | None:
        """The LoRA adapter `model` names, None for a name of the base model; a 404 for any other name."""
        if model in self.model_names:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            raise APIError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")
        return adapter.request

    def check_generates(self, model: str) -> None:
        """Refuse text generation from a model that only pools (the engine would refuse it too, later)."""
        pooling = self.pooling
        if pooling is None or pooling.generates:
            return
        what = (
            "an embedding model: it answers /v1/embeddings, /v1/score and /v1/rerank"
            if pooling.kind == "embed"
            else "a cross-encoder: it answers /v1/score and /v1/rerank"
        )
        raise invalid_request(
            f"The model '{model}' is {what}, and does not generate text.", "model", code="model_does_not_generate"
        )

    def check_request(self, body: GenerationRequest) -> LoRARequest | None:
        """Refuse, before any prompt is built, a request the server cannot take now or cannot honour; the LoRA
        adapter it runs with (None: the base model), looked up once, so that an unload in the meantime cannot
        turn it into a request for the base."""
        self.lifecycle.check_accepting()
        lora = self.check_model(body.model)
        self.check_generates(body.model)
        body.check_supported(self.template_options)
        vocab_size = self.tokenizer.vocab_size
        # The Responses API has no stop ids; chat and completions do.
        stop_ids = getattr(body, "stop_token_ids", None) or []
        bad = next((i for i, token in enumerate(stop_ids) if token >= vocab_size), None)
        if bad is not None:
            # It could never be generated, so it would never stop anything: refused rather than silently inert.
            raise invalid_request(
                f"Token id {stop_ids[bad]} is outside the vocabulary [0, {vocab_size}).", f"stop_token_ids[{bad}]"
            )
        return lora


class Generation:
    """One API call in flight: its engine requests, its choices, its deadline, and its cleanup."""

    def __init__(
        self,
        ctx: ServingContext,
        response_id: str,
        model: str,
        prompts: list[list[int]],
        num_choices: int,
        group: RequestGroup,
        choices: list[ChoiceState],
        arrival: float,
        include_usage: bool,
        continuous_usage: bool = False,
        predicted: bool = False,
    ) -> None:
        self.ctx = ctx
        self.id = response_id
        self.model = model
        """The name the response reports: the LoRA adapter's, or the base model's first served name (as vLLM)."""
        self.created = int(time.time())
        self.prompts = prompts
        self.num_choices = num_choices
        self.group = group
        self.choices = choices
        self.include_usage = include_usage
        """A stream's chunks carry `usage` (null, then the totals in a last chunk of their own)."""
        self.continuous_usage = continuous_usage
        """Every chunk's `usage` is the count so far, not null."""
        self.timers = [RequestTimer(ctx.metrics, arrival) for _ in choices]
        self._unfinished = len(choices)
        self.predicted = predicted
        """The call sent a prediction: its usage counts the prediction's tokens."""
        self._closed = False
        ctx.lifecycle.request_started()
        self._deadline = request_deadline(ctx, arrival, group)

    @property
    def done(self) -> bool:
        return self._unfinished == 0

    async def admitted(self) -> None:
        """Wait until the engine took every request; map its refusal to the API's error."""
        await wait_admitted(self.group)
        for prompt in self.prompts:
            self.ctx.metrics.prompt_tokens.inc(len(prompt) * self.num_choices)

    async def updates(self) -> AsyncIterator[tuple[int, ChoiceUpdate]]:
        """Each engine delta folded into its choice, with the choice's index, until every choice has finished."""
        while not self.done:
            try:
                index, output, received = await self.group.get()
            except EngineDeadError as exc:
                raise engine_failure(str(exc)) from exc
            update = self._apply(index, output, received)
            if update is not None:
                yield index, update

    def _apply(self, index: int, output: StepOutput, received: float) -> ChoiceUpdate | None:
        """None for leftovers of a choice already finished (a stop string ended it before the engine did)."""
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
        details = None
        if self.predicted:
            # OpenAI bills rejected prediction tokens as completion tokens: they were computed like the others.
            details = CompletionTokensDetails(
                accepted_prediction_tokens=sum(c.prediction_tokens[0] for c in self.choices),
                rejected_prediction_tokens=sum(c.prediction_tokens[1] for c in self.choices),
            )
            completion_tokens += details.rejected_prediction_tokens
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
            completion_tokens_details=details,
        )

    def _envelope(self, response_type: type[BaseModel], choices: Sequence[BaseModel], usage: Usage | None) -> BaseModel:
        """A response or chunk object: the fields every one of them repeats around its choices."""
        return response_type(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    async def json_response(
        self, request: Request, response_type: type[BaseModel], final_choice: Callable[[ChoiceState], BaseModel]
    ) -> Response:
        """Run every choice to its end, then answer with one `response_type` holding `final_choice` of each."""

        async def collect() -> BaseModel:
            async for _ in self.updates():
                pass
            return self._envelope(response_type, [final_choice(c) for c in self.choices], self.usage())

        return await self.whole_response(request, collect)

    async def whole_response(self, request: Request, build: Callable[[], Awaitable[BaseModel]]) -> Response:
        """Answer with what `build` makes of the updates (it consumes them), unless the client leaves first."""

        async def work() -> Response:
            return Response((await build()).model_dump_json(), media_type="application/json")

        return await unless_disconnected(request, work(), self.close)

    def stream_response(
        self, chunk_type: type[BaseModel], chunk_choices: AsyncIterator[Sequence[BaseModel]]
    ) -> SSEResponse:
        """Send each list of chunk choices as one `chunk_type` event, then the usage chunk if asked for, then
        [DONE]; an error after the first byte becomes `data: {"error": ...}` before the [DONE]."""
        exclude = None if self.include_usage else {"usage"}

        def event(choices: Sequence[BaseModel], usage: Usage | None = None) -> bytes:
            return sse_data(self._envelope(chunk_type, choices, usage).model_dump_json(exclude=exclude))

        async def events() -> AsyncIterator[bytes]:
            async for choices in chunk_choices:
                yield event(choices, self.usage() if self.continuous_usage else None)
            if self.include_usage:
                yield event([], self.usage())
            yield SSE_DONE

        return self.event_stream(events(), lambda error: [sse_data(error.json()), SSE_DONE])

    def event_stream(
        self, events: AsyncIterator[bytes], error_events: Callable[[APIError], Iterable[bytes]]
    ) -> SSEResponse:
        """Stream SSE frames; a failure after the first byte ends the stream with `error_events(error)`."""
        return SSEResponse(self._guarded(events, error_events), on_close=self.close, ping_interval=self.ctx.sse_ping)

    async def _guarded(
        self, events: AsyncIterator[bytes], error_events: Callable[[APIError], Iterable[bytes]]
    ) -> AsyncIterator[bytes]:
        try:
            async for frame in events:
                yield frame
        except APIError as exc:
            reason = rejection_reason(exc.status_code)
            if reason is not None:
                self.ctx.metrics.count_rejection(reason)
            for frame in error_events(exc):
                yield frame
        except Exception:
            logger.exception("Stream failed")
            for frame in error_events(internal_error()):
                yield frame

    def close(self) -> None:
        """Abort what still runs and release everything; idempotent, called however the response ended."""
        if self._closed:
            return
        self._closed = True
        if self._deadline is not None:
            self._deadline.cancel()
        self.group.close()
        self.ctx.lifecycle.request_finished()


async def start_generation(
    ctx: ServingContext,
    response_id: str,
    prompts: list[list[int]],
    body: GenerationRequest,
    max_tokens: int | None,
    *,
    logprobs: bool,
    top_logprobs: int,
    param: str,
    arrival: float,
    constraint: Constraint | None = None,
    tool_reader: Callable[[], ToolCallReader] | None = None,
    reasoning_splitter: Callable[[], ReasoningSplitter] | None = None,
    prediction: list[int] | None = None,
    lora: LoRARequest | None = None,
    batch: bool = False,
    harmony: Harmony | None = None,
    images: tuple[ImageInput, ...] = (),
) -> Generation:
    """Validate lengths, submit every choice's engine request, and wait until the engine took them all.

    `param` names the request field the prompts came from, for length errors; `max_tokens` None means up to
    the context length. `constraint` is enforced on every choice; `reasoning_splitter` makes each choice's splitter
    of reasoning from answer, `tool_reader` its reader of tool calls (None: no such stage). `prediction`: the
    tokens every choice's answer is predicted to be (Predicted Outputs). `lora`: the adapter every choice runs with
    (check_request's answer). `batch`: the call is a line of the Batch API (`is_batch`), whose engine requests
    wait behind every interactive request. `harmony`: the prompts are Harmony's; each choice's reply is read by
    its reader and stops at `<|return|>` or `<|call|>`. `images`: the images among the (one) prompt's tokens.
    """
    structured_output = None
    if constraint is not None:
        await check_constraint(constraint, ctx.model_dir)
        structured_output = constraint.output
    n = body.num_choices
    requests: list[EngineRequest] = []
    choices: list[ChoiceState] = []
    for p, prompt in enumerate(prompts):
        max_new_tokens = _max_new_tokens(ctx.max_model_len, prompt, max_tokens, param)
        for i in range(n):
            params = body.sampling_params(
                max_new_tokens=max_new_tokens,
                choice_index=i,
                logprobs=logprobs,
                top_logprobs=top_logprobs,
                structured_output=structured_output,
            )
            if harmony is not None:
                params = dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, *harmony.stop_token_ids))
            requests.append(
                EngineRequest(
                    f"{response_id}-{p}-{i}",
                    prompt,
                    params,
                    body.priority,
                    batch=batch,
                    prediction=tuple(prediction or ()),
                    lora=lora,
                    images=images,
                )
            )
            choices.append(
                ChoiceState(
                    index=p * n + i,
                    tokenizer=ctx.tokenizer,
                    prompt_ids=prompt,
                    stop=body.stop_strings,
                    keep_logprobs=logprobs and not body.stream,
                    reasoning_splitter=reasoning_splitter() if reasoning_splitter is not None else None,
                    tool_reader=None if tool_reader is None else tool_reader(),
                    harmony=None if harmony is None else harmony.reader(),
                )
            )
    try:
        group = ctx.client.submit(requests)
    except EngineDeadError as exc:
        raise APIError(503, str(exc), type="service_unavailable_error", code="engine_dead") from exc
    generation = Generation(
        ctx,
        response_id,
        ctx.model_name if lora is None else lora.name,
        prompts,
        n,
        group,
        choices,
        arrival,
        body.include_usage,
        body.continuous_usage,
        predicted=prediction is not None,
    )
    try:
        await generation.admitted()
    except BaseException:
        generation.close()
        raise
    return generation


def _max_new_tokens(limit: int, prompt: Sequence[int], requested: int | None, param: str) -> int:
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


def request_deadline(ctx: ServingContext, arrival: float, group: RequestGroup) -> asyncio.TimerHandle | None:
    """Fail `group` with a 504 once the server's request timeout has passed since `arrival` (None: no timeout)."""
    if not ctx.request_timeout:
        return None
    remaining = max(0.0, arrival + ctx.request_timeout - time.monotonic())
    timeout = APIError(
        504,
        f"The request did not finish within the server's request timeout ({ctx.request_timeout:g}s).",
        type="timeout_error",
        code="request_timeout",
    )
    return asyncio.get_running_loop().call_later(remaining, group.fail, timeout)


async def wait_admitted(group: RequestGroup) -> None:
    """Wait until the engine took every request of `group`; its refusal as the API's error (429, 400, 500)."""
    try:
        await group.wait_admitted()
    except QueueFull as exc:
        raise APIError(
            429,
            f"The server's request queue is full ({exc}); retry after {RETRY_AFTER_SECONDS}s.",
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        ) from exc
    except RequestRejected as exc:
        param = {"invalid_priority": "priority", "invalid_logit_bias": "logit_bias"}.get(exc.code)
        raise invalid_request(str(exc), param=param, code=exc.code) from exc
    except (EngineDeadError, EngineAddFailed) as exc:
        raise engine_failure(str(exc)) from exc


async def unless_disconnected(
    request: Request, work: Coroutine[Any, Any, Response], close: Callable[[], None]
) -> Response:
    """Run a non-streaming response's work, abandoning it (and its engine requests) if the client leaves; `close`
    releases the call's engine requests however it ended."""
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
        close()


async def _client_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
