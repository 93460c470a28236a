"""engine/core/driver.py's loop on the demo model: what it publishes, and in which order."""

from __future__ import annotations

from collections import deque
from pathlib import Path

import pytest

from engine import EngineConfig, EngineCore, SamplingParams, generate_batch
from engine.core.driver import AddRequests, EngineInput, EngineLoop, EngineOutput, EngineRequest, Shutdown, StepMessage
from engine.core.request import RequestRejected

DEMO = Path(__file__).resolve().parents[1] / "server" / "default_model"


class _Script:
    """An inbox that hands out its messages one pass at a time, then asks the loop to drain and stop."""

    def __init__(self, *passes: list[EngineInput]) -> None:
        self.passes = deque(passes)

    def receive(self, timeout: float, limit: int) -> list[EngineInput]:
        return self.passes.popleft() if self.passes else [Shutdown(drain=True)]


def test_adds_are_answered_before_the_step_that_runs_them() -> None:
    """A server starts an accepted request's response while its first step computes: the answer comes in a message
    of its own, ahead of that step's outputs, and a bad request's rejection does not wait for a step either."""
    engine = EngineCore(EngineConfig.of(model=str(DEMO)))
    good = EngineRequest("good", [1, 2, 3, 4], SamplingParams(max_new_tokens=3))
    too_long = EngineRequest("too_long", [1] * (engine.max_model_len + 1), SamplingParams(max_new_tokens=1))
    published: list[EngineOutput] = []
    EngineLoop(engine, _Script([AddRequests([good, too_long])]), published.append).run()
    steps = [m for m in published if isinstance(m, StepMessage)]
    answer, first_step = steps[0], steps[1]
    assert answer.accepted == ["good"] and [r.request_id for r in answer.rejected] == ["too_long"]
    assert answer.outputs == []
    assert [o.request_id for o in first_step.outputs] == ["good"] and not first_step.accepted
    generated = [t for m in steps for o in m.outputs for t in o.new_token_ids]
    assert len(generated) == 3 and steps[-1].outputs[-1].finished
    assert all(not m.accepted and not m.rejected for m in steps[1:])


def test_a_rejected_prompt_leaves_the_engine_clean_for_the_next_batch() -> None:
    """The rejection raises as soon as it is answered, before the batch's other requests ran: they are ended, so
    the engine (and their ids) are free for the next call."""
    engine = EngineCore(EngineConfig.of(model=str(DEMO)))
    with pytest.raises(RequestRejected):
        generate_batch([[1, 2, 3], [1] * (engine.max_model_len + 1)], engine=engine)
    assert engine.is_idle_and_clean()
    again = generate_batch([[1, 2, 3]], engine=engine, params=SamplingParams(max_new_tokens=2))
    assert len(again["req_0"].generated_ids) == 2
