"""/v1/responses: instructions and input items (and tools) -> prompt (the model's chat template) -> generation -> a
response object, or the stream of events the OpenAI SDK assembles into one.

Output items come in the order the model writes them: its reasoning (with a reasoning parser), the answer's
message, its function calls; each item closes when the next one opens. A stream sends `response.created` and
`response.in_progress`, then per item `response.output_item.added` (and `response.content_part.added` for text),
its text or arguments in deltas (`response.reasoning_text.delta`, `response.output_text.delta`,
`response.function_call_arguments.delta`), the matching `...done` events and `response.output_item.done`, and
last `response.completed` (`response.incomplete` when the token limit cut the answer short) with the whole
response. A non-streaming request gets that last event's response, built by the same code, so the two agree. A
failure after the stream started is an `error` event, then `response.failed`. There is no `[DONE]`.

State (server/state/): a response is stored (`store`, the default) when it ends, with its turn's input items:
completed or incomplete, failed after its stream started, or its stream cut off by the client leaving (kept as far
as it got, `incomplete`); one whose id no client saw (a non-streaming request that failed, or whose client left)
is not. `previous_response_id` renders the stored chain before the input; `conversation` renders the
conversation's items before it, and a response that came to its end (completed, or cut by the token limit) adds
its input and output items to the conversation. `background` answers at once, `queued`, and generates in a task of
this replica (server/openai/stored_responses.py), its row updated as it runs and when it ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import TypeAdapter

from engine.multimodal.inputs import ImageInput
from server.openai.choices import ChoiceUpdate
from server.openai.conversations import conversation_not_found
from server.openai.errors import APIError, internal_error, invalid_request, unsupported_parameter
from server.openai.generation import Generation, ServingContext, is_batch, start_generation
from server.openai.images import ImageRef
from server.openai.responses_input import stored_items, template_messages
from server.openai.responses_schemas import (
    EchoedFunctionTool,
    EchoedReasoning,
    EchoedTextConfig,
    FunctionCallOutput,
    FunctionToolChoice,
    IncompleteDetails,
    InputItem,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseConversation,
    ResponseError,
    ResponseObject,
    ResponsesFunctionTool,
    ResponsesRequest,
    ResponseUsage,
)
from server.openai.stored_responses import FLUSH_SECONDS, EventLog, background_runner
from server.openai.template import EFFORT_VARIABLE, render_conversation
from server.openai.tool_parsers.base import ToolCallDelta
from server.sse import SSEResponse, sse_typed_events
from server.state import conversations, responses
from server.state.keys import request_owner
from server.state.stored import StoredState

logger = logging.getLogger(__name__)

Event = dict[str, Any]
"""One stream event: its `type`, `sequence_number` and fields, JSON-ready."""

_DETACHED: set[asyncio.Task[None]] = set()
"""Stores of streams cut short, running on after their stream's task was cancelled (held here until done)."""


async def serve_response(ctx: ServingContext, body: ResponsesRequest, request: Request) -> Response:
    arrival = time.monotonic()
    lora = ctx.check_request(body)
    if body.background and is_batch(request):
        raise unsupported_parameter("background", "a batch's requests are run in the background already.")
    format_constraint = body.format_constraint()
    tool_use = harmony = None
    if ctx.harmony is not None:
        tools = ctx.harmony.offered_tools(
            body.function_tools(), body.tool_choice_value(), parameters_field="parameters"
        )
        constraint = ctx.harmony.constraint(tools, body.tool_choice_value(), format_constraint)
        harmony = dataclasses.replace(ctx.harmony, calls=bool(tools))
    else:
        tool_use = ctx.tool_use(
            body.function_tools(), body.tool_choice_value(), body.parallel_tool_calls, parameters_field="parameters"
        )
        constraint = tool_use.constraint(format_constraint) if tool_use else format_constraint
    owner = request_owner(request)
    turn = _turn_items(body.input)
    earlier = await _earlier_items(ctx, owner, body)
    image_refs: list[ImageRef] = []
    messages = template_messages(body.instructions, [*earlier, *turn] if earlier else body.input, image_refs)
    ctx.check_images(image_refs)
    images: tuple[ImageInput, ...] = ()
    if ctx.harmony is not None:
        effort = body.template_kwargs(ctx.template_options).get(EFFORT_VARIABLE)
        prompt = ctx.harmony.render(messages, tools, effort, "input", effort_param="reasoning.effort")
        splitter = None
    else:
        prompt_text = render_conversation(
            ctx.tokenizer,
            messages,
            body.template_kwargs(ctx.tokenizer.chat_template_options),
            tool_use.template_tools() if tool_use else None,
            "input",
        )
        prompt, images = await ctx.prompt_ids(prompt_text, image_refs, "input")
        # A constrained answer is grammar-bound from its first token: it has no reasoning to split off.
        reasoning = ctx.reasoning if constraint is None else None
        splitter = None if reasoning is None else functools.partial(reasoning.splitter, prompt_text)
    response_id = f"resp_{uuid.uuid4().hex}"
    generation = await start_generation(
        ctx,
        response_id,
        [prompt],
        body,
        body.max_output_tokens,
        logprobs=False,
        top_logprobs=0,
        param="input",
        arrival=arrival,
        constraint=constraint,
        reasoning_splitter=splitter,
        tool_reader=tool_use.reader_factory() if tool_use else None,
        lora=lora,
        batch=is_batch(request),
        harmony=harmony,
        images=images,
    )
    assembler = ResponseAssembler(_in_progress(body, response_id, generation.created, generation.model))
    record = _Record(ctx.stored, owner, body.store is not False, body.conversation_id, bool(body.background), turn)
    if body.background:
        return await _start_background(record, generation, assembler, bool(body.stream))
    if body.stream:
        return generation.event_stream(
            _stream(generation, assembler, record), lambda error: _frames(assembler.fail(error))
        )

    async def build() -> ResponseObject:
        async for _, update in generation.updates():
            assembler.feed(update)
        assembler.finish(generation.choices[0].finish_reason, _usage(generation))
        await record.ended(assembler.response)
        return assembler.response

    return await generation.whole_response(request, build)


@dataclass
class _Record:
    """Where a response is recorded: its row (`store`, or always in the background) and its conversation."""

    stored: StoredState | None
    owner: str
    store: bool
    conversation_id: str | None
    background: bool
    turn: list[InputItem]
    input_items: list[dict[str, Any]] = field(init=False)
    """This turn's input as stored: the response's input_items, and what its conversation gets."""

    def __post_init__(self) -> None:
        self.input_items = stored_items(self.turn)

    async def created(self, response: ResponseObject, events: list[Event]) -> None:
        """A background response's row, leased to this replica, before it runs (its owner's quota checked), with
        its first stream `events` (created with `stream`)."""
        assert self.stored is not None
        async with self.stored.db().transaction() as connection:
            await responses.add(connection, self.stored, self.owner, response.model_dump(mode="json"),
                                self.input_items, worker=self.stored.worker)  # fmt: skip
            await responses.add_events(connection, response.id, events)

    async def progressed(self, response: ResponseObject, events: list[Event]) -> None:
        """A background response as it stands, with its stream events since the last write, for those who poll
        or stream it."""
        assert self.stored is not None
        async with self.stored.db().transaction() as connection:
            await responses.update_running(connection, response.model_dump(mode="json"), events)

    async def ended(self, response: ResponseObject, events: list[Event] | None = None, quota: bool = True) -> None:
        """Record how the response ended (a background one with its last stream `events`, its owner's quota
        checked unless not `quota`); one that came to its end (completed, or cut by the token limit) adds its
        input and output items to its conversation, in the same transaction."""
        if self.stored is None or not (self.store or self.conversation_id):
            return
        dumped = response.model_dump(mode="json")
        async with self.stored.db().transaction() as connection:
            if self.background:
                checked = self.stored if quota else None
                if not await responses.update_running(connection, dumped, events, checked):
                    return  # cancelled or deleted meanwhile: that stands
            elif self.store:
                await responses.add(connection, self.stored, self.owner, dumped, self.input_items)
            answered = response.status == "completed" or response.incomplete_details is not None
            if self.conversation_id is None or not answered:
                return
            # A conversation deleted while the response ran has nothing to add to.
            if await conversations.get(connection, self.owner, self.conversation_id) is not None:
                await conversations.append(connection, self.stored, self.owner, self.conversation_id,
                                           [*self.input_items, *dumped["output"]])  # fmt: skip

    def ended_later(self, assembler: ResponseAssembler) -> None:
        """Record a stream that ended short, from a task of its own: its stream's task is being cancelled (the
        client left), or is about to fail the response (event_stream's handler runs `fail` before this task). Only
        a stored response has anything to record: its conversation takes only responses that came to their end."""
        if not self.store:
            return

        async def record() -> None:
            if assembler.response.status == "in_progress":  # not failed: the client left
                assembler.cut_off()
            await self.ended(assembler.response)

        task = asyncio.get_running_loop().create_task(record())
        _DETACHED.add(task)
        task.add_done_callback(_detached_done)


def _detached_done(task: asyncio.Task[None]) -> None:
    _DETACHED.discard(task)
    if not task.cancelled() and task.exception() is not None:
        logger.error("Storing a response cut short failed", exc_info=task.exception())


async def _start_background(
    record: _Record, generation: Generation, assembler: ResponseAssembler, stream: bool
) -> Response:
    """Store the response `queued`, answer with it (`stream`: with its event stream, which goes on without the
    client), and generate it in a task of this replica."""
    response = assembler.response
    response.status = "queued"
    assert record.stored is not None  # the app's serving context always has its stored state
    log = EventLog() if stream else None
    first = assembler.queued() if stream else []
    try:
        await record.created(response, first)
    except BaseException:
        generation.close()
        raise
    answer = Response(response.model_dump_json(), media_type="application/json")
    runner = background_runner(record.stored)
    runner.launch(response.id, _background(record, generation, assembler, log), log)
    if log is None:
        return answer
    log.add(first)
    return SSEResponse(
        runner.follow(record.owner, response.id, -1), on_close=lambda: None, ping_interval=generation.ctx.sse_ping
    )


async def _background(
    record: _Record, generation: Generation, assembler: ResponseAssembler, log: EventLog | None
) -> None:
    """Generate a background response and record how it ended; cancelled (by a cancel, a delete, the server
    stopping), it records nothing: whoever cancelled it has. `log`: its stream events (created with `stream`),
    written to the database every FLUSH_SECONDS and at its end."""
    unwritten: list[Event] = []
    written = time.monotonic()
    streamed = log is not None

    def keep(events: list[Event]) -> None:
        if log is not None:
            log.add(events)
            unwritten.extend(events)

    try:
        try:
            async for _, update in generation.updates():
                if assembler.response.status == "queued":
                    assembler.response.status = "in_progress"
                    keep(assembler.running())
                    written = 0.0  # its new status, at once
                keep(assembler.feed(update))
                if time.monotonic() - written >= FLUSH_SECONDS:
                    await record.progressed(assembler.response, unwritten)
                    unwritten = []
                    written = time.monotonic()
            last = assembler.finish(generation.choices[0].finish_reason, _usage(generation))
        except APIError as error:
            last = assembler.fail(error)
        except Exception:
            logger.exception("Background response %s failed", assembler.response.id)
            last = assembler.fail(internal_error())
        finally:
            generation.close()
        # Its last events are sent only once they are recorded: a response the quota refuses ends failed instead.
        try:
            await record.ended(assembler.response, [*unwritten, *last] if streamed else [])
        except APIError as error:  # its output would take the owner past the quota: failed, its output not kept
            assembler.response.output = []
            last = assembler.fail(error)
            await record.ended(assembler.response, [*unwritten, *last] if streamed else [], quota=False)
        keep(last)
    finally:
        if log is not None:
            log.end()


async def _stream(generation: Generation, assembler: ResponseAssembler, record: _Record) -> AsyncIterator[bytes]:
    finished = False
    try:
        for frame in _frames(assembler.start()):
            yield frame
        async for _, update in generation.updates():
            for frame in _frames(assembler.feed(update)):
                yield frame
        last = _frames(assembler.finish(generation.choices[0].finish_reason, _usage(generation)))
        finished = True
        await record.ended(assembler.response)  # before the last event: a client that reads it can retrieve it
        for frame in last:
            yield frame
    finally:
        if not finished:
            record.ended_later(assembler)


_ITEMS = TypeAdapter(list[InputItem])


def _turn_items(input: str | list[InputItem]) -> list[InputItem]:
    """This turn's input as items (a text input is a user message)."""
    if isinstance(input, str):
        return _ITEMS.validate_python([{"type": "message", "role": "user", "content": input}])
    return input


async def _earlier_items(ctx: ServingContext, owner: str, body: ResponsesRequest) -> list[InputItem]:
    """What comes before this turn's input: the stored chain ending at `previous_response_id` (each turn's input
    and output), or the conversation's items; oldest first."""
    previous, conversation_id = body.previous_response_id, body.conversation_id
    if previous is None and conversation_id is None:
        return []
    param = "previous_response_id" if previous is not None else "conversation"
    if ctx.stored is None:
        raise invalid_request("This server stores no responses nor conversations.", param)
    async with ctx.stored.db().transaction() as connection:
        if previous is not None:
            items = await responses.conversation(connection, owner, previous)
            if items is None:
                raise APIError(404, f"Previous response with id '{previous}' not found.", param=param,
                               code="previous_response_not_found")  # fmt: skip
        else:
            assert conversation_id is not None
            if await conversations.get(connection, owner, conversation_id) is None:
                raise conversation_not_found(conversation_id, param)
            items = await conversations.items(connection, owner, conversation_id)
    return _ITEMS.validate_python(items)


def _frames(events: list[Event]) -> list[bytes]:
    """The events of one update as one chunk: each chunk costs the SSE response a send (BENCHMARKS.md)."""
    if not events:
        return []
    return [sse_typed_events(events)]


def _in_progress(body: ResponsesRequest, response_id: str, created: int, model: str) -> ResponseObject:
    """The response as `response.created` shows it: the request's settings echoed, no output yet."""
    tool_choice: str | dict[str, Any] = "auto"
    if isinstance(body.tool_choice, FunctionToolChoice):
        tool_choice = body.tool_choice.model_dump()
    elif isinstance(body.tool_choice, str):
        tool_choice = body.tool_choice
    text_format = body.text.format if body.text is not None else None
    return ResponseObject(
        id=response_id,
        created_at=created,
        status="in_progress",
        previous_response_id=body.previous_response_id,
        store=body.store is not False,
        background=bool(body.background),
        conversation=None if body.conversation_id is None else ResponseConversation(id=body.conversation_id),
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        model=model,
        output=[],
        parallel_tool_calls=body.parallel_tool_calls is not False,
        reasoning=EchoedReasoning(effort=body.reasoning.effort if body.reasoning else None),
        temperature=1.0 if body.temperature is None else body.temperature,
        text=EchoedTextConfig(
            format=text_format.model_dump(by_alias=True, exclude_none=True) if text_format else {"type": "text"}
        ),
        tool_choice=tool_choice,
        tools=[
            EchoedFunctionTool(**tool.model_dump(exclude={"type"}))
            for tool in body.tools or ()
            if isinstance(tool, ResponsesFunctionTool)
        ],
        top_p=1.0 if body.top_p is None else body.top_p,
        user=body.user,
        metadata=body.metadata or {},
    )


def _usage(generation: Generation) -> ResponseUsage:
    usage = generation.usage()
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=generation.choices[0].num_reasoning_tokens),
        total_tokens=usage.total_tokens,
    )


class ResponseAssembler:
    """One choice's updates in; output items, and the events that stream them, out.

    `response` grows as the items do, so when `finish` returns it is the whole response. Answer text that is
    only whitespace waits (`_layout`) until text follows it: next to function calls it is layout, as chat's
    `content: null` beside tool calls.
    """

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self._sequence = 0
        self._open: OutputItem | None = None
        self._calls: dict[int, FunctionCallOutput] = {}
        """The function-call item of each of the tool-call reader's call indexes."""
        self._layout = ""

    def start(self) -> list[Event]:
        snapshot = self.response.model_dump(mode="json")
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def queued(self) -> list[Event]:
        """A background response's first events: created, and queued; `running` follows when it starts."""
        snapshot = self.response.model_dump(mode="json")
        return [
            self._event("response.created", response=snapshot),
            self._event("response.queued", response=snapshot),
        ]

    def running(self) -> list[Event]:
        return [self._event("response.in_progress", response=self.response.model_dump(mode="json"))]

    def feed(self, update: ChoiceUpdate) -> list[Event]:
        events = []
        if update.reasoning:
            events += self._reasoning(update.reasoning)
        if update.text:
            events += self._answer(update.text)
        for call in update.tool_calls:
            events += self._call(call)
        return events

    def finish(self, finish_reason: str | None, usage: ResponseUsage) -> list[Event]:
        """Close the last item and the response; "length" (the token limit) makes both incomplete."""
        events = []
        has_calls = any(isinstance(item, FunctionCallOutput) for item in self.response.output)
        if (self._layout and not has_calls) or not self.response.output:
            events += self._open_message(self._layout)
        cut_short = finish_reason == "length"
        events += self._close("incomplete" if cut_short else "completed")
        response = self.response
        response.status = "incomplete" if cut_short else "completed"
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens") if cut_short else None
        response.usage = usage
        response.completed_at = int(time.time())
        kind = "response.incomplete" if cut_short else "response.completed"
        return [*events, self._event(kind, response=response.model_dump(mode="json"))]

    def cut_off(self) -> None:
        """The client left mid-stream: the response as far as it got, `incomplete` (nobody reads its events)."""
        self._close("incomplete")
        self.response.status = "incomplete"

    def fail(self, error: APIError) -> list[Event]:
        """The generation failed after the stream started: the error, then the response as far as it got."""
        events = self._close("incomplete")
        info = error.info
        events.append(self._event("error", code=info.code, message=info.message, param=info.param))
        self.response.status = "failed"
        code = "rate_limit_exceeded" if error.status_code == 429 else "server_error"
        self.response.error = ResponseError(code=code, message=info.message)
        return [*events, self._event("response.failed", response=self.response.model_dump(mode="json"))]

    # ------------------------------------------------------------------ items

    def _reasoning(self, text: str) -> list[Event]:
        events = []
        item = self._open
        if not isinstance(item, ReasoningItem):
            item = ReasoningItem(id=f"rs_{uuid.uuid4().hex}", status="in_progress", content=[])
            events += self._add(item)
            item.content.append(ReasoningText(text=""))
            events.append(self._part_event("response.content_part.added", item, item.content[0]))
        item.content[0].text += text
        return [*events, self._text_event("response.reasoning_text.delta", item, delta=text)]

    def _answer(self, text: str) -> list[Event]:
        item = self._open
        if isinstance(item, OutputMessage):
            item.content[0].text += text
            return [self._text_event("response.output_text.delta", item, delta=text, logprobs=[])]
        if text.isspace():
            self._layout += text
            return []
        text, self._layout = self._layout + text, ""
        return self._open_message(text)

    def _open_message(self, text: str) -> list[Event]:
        item = OutputMessage(id=f"msg_{uuid.uuid4().hex}", status="in_progress", content=[])
        events = self._add(item)
        item.content.append(OutputText(text=""))
        events.append(self._part_event("response.content_part.added", item, item.content[0]))
        if text:
            item.content[0].text = text
            events.append(self._text_event("response.output_text.delta", item, delta=text, logprobs=[]))
        return events

    def _call(self, delta: ToolCallDelta) -> list[Event]:
        events = []
        if delta.id is not None:
            item = FunctionCallOutput(
                id=f"fc_{uuid.uuid4().hex}", status="in_progress", call_id=delta.id, name=delta.name or "", arguments=""
            )
            self._calls[delta.index] = item
            events += self._add(item)
        item = self._calls[delta.index]
        if delta.arguments:
            item.arguments += delta.arguments
            events.append(self._item_event("response.function_call_arguments.delta", item, delta=delta.arguments))
        return events

    def _add(self, item: OutputItem) -> list[Event]:
        """Close the open item, open `item`; a text item's part follows in its own event."""
        events = self._close("completed")
        self.response.output.append(item)
        self._open = item
        return [*events, self._event("response.output_item.added", output_index=self._index(item), item=_dump(item))]

    def _close(self, status: str) -> list[Event]:
        item = self._open
        if item is None:
            return []
        self._open = None
        item.status = status  # type: ignore[assignment]
        events = []
        if isinstance(item, ReasoningItem):
            part = item.content[0]
            events.append(self._text_event("response.reasoning_text.done", item, text=part.text))
            events.append(self._part_event("response.content_part.done", item, part))
        elif isinstance(item, OutputMessage):
            part = item.content[0]
            events.append(self._text_event("response.output_text.done", item, text=part.text, logprobs=[]))
            events.append(self._part_event("response.content_part.done", item, part))
        else:
            events.append(self._item_event("response.function_call_arguments.done", item, arguments=item.arguments))
        return [*events, self._event("response.output_item.done", output_index=self._index(item), item=_dump(item))]

    # ------------------------------------------------------------------ events

    def _index(self, item: OutputItem) -> int:
        return next(i for i, other in enumerate(self.response.output) if other is item)

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _item_event(self, kind: str, item: OutputItem, **fields: Any) -> Event:
        return self._event(kind, item_id=item.id, output_index=self._index(item), **fields)

    def _text_event(self, kind: str, item: OutputItem, **fields: Any) -> Event:
        return self._item_event(kind, item, content_index=0, **fields)

    def _part_event(self, kind: str, item: OutputItem, part: OutputText | ReasoningText) -> Event:
        return self._text_event(kind, item, part=_dump(part))


def _dump(model: OutputItem | OutputText | ReasoningText) -> dict[str, Any]:
    return model.model_dump(mode="json")
