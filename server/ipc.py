"""Messages between the front end and the engine process (pickled over multiprocessing pipes).

Front end -> engine: `AddRequests`, `AbortRequests`, `Shutdown`.
Engine -> front end: `EngineReady` once, then one `StepMessage` per engine step (every request's deltas plus the
engine's stats), a `Heartbeat` per second while idle, and `EngineFailed` just before dying of an exception.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from engine.request import SamplingParams, StepOutput

if TYPE_CHECKING:
    from engine.stats import EngineStats


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class AddRequests:
    requests: list[EngineRequest]


@dataclass(frozen=True, slots=True)
class AbortRequests:
    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


RejectionKind = Literal["invalid", "queue_full", "internal"]


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why the engine refused to add a request (exceptions do not pickle with their extra fields)."""

    request_id: str
    kind: RejectionKind
    message: str
    code: str


@dataclass(frozen=True, slots=True)
class EngineReady:
    max_model_len: int
    eos_token_ids: frozenset[int]
    model_name: str


@dataclass(slots=True)
class StepMessage:
    stats: EngineStats
    outputs: list[StepOutput] = field(default_factory=list)
    accepted: list[str] = field(default_factory=list)
    """Requests added since the previous message; they precede their own outputs."""
    rejected: list[Rejection] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class EngineFailed:
    message: str
