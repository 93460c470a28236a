"""The one engine loop, and the typed messages it takes and emits.

Every way of running the engine goes through `EngineLoop`: `generate_batch` (in the calling thread), the
`ContinuousBatchingManager` (a background thread) and the server's engine process (over pipes). Each supplies
an `Inbox` that the loop drains between steps, and a `publish` callback that receives a message per step (and one
answering the adds before the step that runs them).
The transports differ; the protocol, defined here, does not.

Loop: take the waiting messages (adds, aborts, shutdown); answer the adds decided since the last pass in one
`StepMessage` of their acceptances and rejections, before the step that runs them; run one step when there is work
and publish ONE `StepMessage` with every request's deltas and the engine's statistics. When there is nothing to do
it waits on the inbox and publishes a `Heartbeat` each time the wait ends empty, so a watcher can tell the loop is
alive; each pass that does not step keeps the engine's tensor-parallel ranks alive instead
(`EngineCore.keep_alive`).

Every add is answered once, accepted or rejected. A request with structured output is answered when its grammar
has compiled (rejected if the constraint is invalid or unsupported, so the front end can still answer 400); the
loop keeps stepping the others meanwhile, and while it has nothing else to do it polls the compiles.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from engine.core.request import LoRARequest, PoolingParams, QueueFull, RequestRejected, SamplingParams, StepOutput
from engine.core.stats import EngineStats
from engine.multimodal.inputs import ImageInput

if TYPE_CHECKING:
    from engine.core.engine_core import EngineCore

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
GRAMMAR_POLL_INTERVAL_S = 0.005
"""While only grammars compile: how long to wait for one before looking at the inbox again."""
MAX_MESSAGES_PER_STEP = 256
"""Messages handled between two steps at most, so a flood of adds cannot stall requests already running."""


# -- into the engine -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0
    """Lower runs first (only with the `priority` scheduling policy)."""
    batch: bool = False
    """A line of the Batch API: it waits behind every interactive request and is preempted before any of them,
    under either scheduling policy, so batch work runs in the capacity interactive requests leave."""
    pooling: PoolingParams | None = None
    """Pool the prompt instead of generating (`params` is then not read): the model must pool (engine/pooling/)."""
    prediction: tuple[int, ...] = ()
    """The output the client predicts (Predicted Outputs): drafts for speculative decoding."""
    lora: LoRARequest | None = None
    """The LoRA adapter to run with (--enable-lora); None: the base model."""
    images: tuple[ImageInput, ...] = ()
    """The images among the prompt's tokens, processed (an image model's; engine/multimodal/)."""


@dataclass(frozen=True, slots=True)
class AddRequests:
    requests: list[EngineRequest]


@dataclass(frozen=True, slots=True)
class AbortRequests:
    request_ids: list[str]
    error: str | None = None
    """Set when the requests end because something failed: their final outputs carry it."""


@dataclass(frozen=True, slots=True)
class Shutdown:
    drain: bool = False
    """Finish the requests in flight first, then stop (instead of stopping now)."""


EngineInput = AddRequests | AbortRequests | Shutdown


# -- out of the engine -----------------------------------------------------------------------------------------

RejectionKind = Literal["invalid", "queue_full", "internal"]


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why the engine refused to add a request (exceptions do not pickle with their extra fields)."""

    request_id: str
    kind: RejectionKind
    message: str
    code: str


@dataclass(slots=True)
class StepMessage:
    stats: EngineStats
    outputs: list[StepOutput] = field(default_factory=list)
    accepted: list[str] = field(default_factory=list)
    """Requests added since the previous message, answered in a message of their own before the step that runs
    them (so they always precede their own outputs)."""
    rejected: list[Rejection] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    stats: EngineStats


EngineOutput = StepMessage | Heartbeat


class Inbox(Protocol):
    def receive(self, timeout: float, limit: int) -> list[EngineInput]:
        """Up to `limit` waiting messages; when none is waiting, wait up to `timeout` seconds (0: do not wait)."""
        ...


class EngineLoop:
    def __init__(self, engine: EngineCore, inbox: Inbox, publish: Callable[[EngineOutput], None]) -> None:
        self.engine = engine
        self.inbox = inbox
        self.publish = publish
        self._accepted: list[str] = []
        self._rejected: list[Rejection] = []

    def run(self) -> None:
        """Until a `Shutdown` (once drained, if it asks for that). Exceptions of the engine propagate."""
        engine = self.engine
        draining = False
        while True:
            busy = engine.has_unfinished()
            compiling = engine.num_awaiting_grammar > 0
            idle_wait = 0 if busy or draining or compiling else HEARTBEAT_INTERVAL_S
            messages = self.inbox.receive(idle_wait, MAX_MESSAGES_PER_STEP)
            for message in messages:
                if isinstance(message, AddRequests):
                    for request in message.requests:
                        self._add(request)
                elif isinstance(message, AbortRequests):
                    for request_id in message.request_ids:
                        engine.abort_request(request_id, message.error)
                elif isinstance(message, Shutdown):
                    if not message.drain:
                        return
                    draining = True
                else:
                    raise TypeError(f"unexpected message for the engine: {message!r}")
            if compiling and not busy and not messages:
                engine.wait_for_grammars(GRAMMAR_POLL_INTERVAL_S)
            self._settle_grammars()
            answered = bool(self._accepted or self._rejected)
            if answered:
                # Answered before the step that runs them: a server starts each accepted response (its headers and
                # first event) while the step computes, instead of after it.
                self.publish(StepMessage(engine.stats(), [], self._accepted, self._rejected))
                self._accepted, self._rejected = [], []
            # Pending aborts count as unfinished: their final ABORT outputs (and freed pages) come from a step.
            stepped = engine.has_unfinished()
            outputs = engine.step() if stepped else []
            if not stepped:
                engine.keep_alive()
            if stepped:
                self.publish(StepMessage(engine.stats(), outputs))
            elif answered or engine.num_awaiting_grammar:
                continue
            elif draining:
                return
            elif not messages:
                self.publish(Heartbeat(engine.stats()))

    def _settle_grammars(self) -> None:
        for request_id, error in self.engine.settle_grammars():
            if error is None:
                self._accepted.append(request_id)
            else:
                self._rejected.append(Rejection(request_id, "invalid", str(error), error.code))

    def _add(self, request: EngineRequest) -> None:
        request_id = request.request_id
        try:
            joined = self.engine.add_request(
                request_id,
                request.prompt_ids,
                request.params,
                request.priority,
                batch=request.batch,
                pooling=request.pooling,
                prediction=request.prediction,
                lora=request.lora,
                images=request.images,
            )
        except QueueFull as exc:
            self._rejected.append(Rejection(request_id, "queue_full", str(exc), "queue_full"))
        except RequestRejected as exc:
            self._rejected.append(Rejection(request_id, "invalid", str(exc), exc.code))
        except Exception as exc:
            # One bad request must not take down everyone else's: report it and keep serving.
            logger.exception("add_request(%s) failed", request_id)
            self._rejected.append(Rejection(request_id, "internal", f"{type(exc).__name__}: {exc}", "internal_error"))
        else:
            if joined:
                self._accepted.append(request_id)
