"""A step observer that writes one JSON line per step: what the scheduler chose from, what it scheduled, and
the phase times. For reading a scheduler's decisions after the fact (`ferry serve --step-log FILE`): which
requests were admitted ahead of which, when a request was preempted, what a slow step held.

A line: `step` (its number), `time` (Unix seconds, when it was applied), `scheduled` (`[request id, tokens already
computed, tokens computed now]` in packing order), `queue` (`[request id, batch]` for each request waiting when the
step was planned, in the scheduler's order), `preempted`, `finished` (request ids), `seconds` (per phase).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from engine.core.observer import StepRecord


class StepLog:
    def __init__(self, path: Path) -> None:
        # Line-buffered: each step is on disk as it ends, so a log of an engine that died holds its last step.
        # Open for the engine process's life: the operating system closes it when that ends.
        self._file = path.open("a", buffering=1, encoding="utf-8")
        self._steps = 0

    def on_step(self, record: StepRecord) -> None:
        plan = record.plan
        self._steps += 1
        line = {
            "step": self._steps,
            "time": round(time.time(), 6),
            "scheduled": [
                [request_id, computed, new]
                for request_id, computed, new in zip(
                    plan.request_ids, plan.num_computed_tokens, plan.num_new_tokens, strict=True
                )
            ],
            "queue": [[queued.request_id, queued.batch] for queued in record.queue],
            "preempted": list(plan.preempted_ids),
            "finished": list(plan.finished_ids),
            "seconds": {phase: round(seconds, 6) for phase, seconds in record.phase_seconds.items()},
        }
        self._file.write(json.dumps(line) + "\n")
