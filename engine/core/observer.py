"""Watching the engine step without touching it: observers subscribe to one record per step.

Benchmarks and tests read batch shapes, phase times and outputs from here instead of wrapping engine methods.
An observer runs in the engine's thread right after the step, so it must be quick.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.core.request import StepOutput
from engine.core.step import ModelRunnerOutput, SchedulerOutput


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    """A request waiting to be admitted, as a step's plan saw it."""

    request_id: str
    batch: bool
    """A batch request (the Batch API): every waiting interactive request is admitted before it."""


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step as it happened: the plan, what the runner produced, what the step emitted, and its phase times."""

    plan: SchedulerOutput
    result: ModelRunnerOutput
    outputs: list[StepOutput]
    queue: tuple[QueuedRequest, ...]
    """The waiting queue the plan chose from, in the scheduler's order (preempted requests included): those of
    them in `plan.request_ids` were admitted by this step."""
    schedule_seconds: float
    update_seconds: float
    """Applying the result: token appends, stop rules, page commits, output deltas."""

    @property
    def phase_seconds(self) -> dict[str, float]:
        return {
            "schedule": self.schedule_seconds,
            "prepare": self.result.prepare_seconds,
            "forward": self.result.forward_seconds,
            "sample": self.result.sample_seconds,
            "update": self.update_seconds,
        }


class StepObserver(Protocol):
    def on_step(self, record: StepRecord) -> None: ...
