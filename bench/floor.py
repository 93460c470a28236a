"""The model floor: the forward passes Ferry ran, replayed with nothing else around them.

Each recorded step shape (per sequence: tokens already cached, tokens computed now, whether its logits are
needed) is rebuilt as a plan of fresh requests over synthetic page tables, packed by the runner outside the timer, and
only `runner.forward` (the forward pass plus logits at the last tokens) is timed. No scheduling, no batch assembly,
no sampling, no output handling: floor / Ferry's wall time is the fraction of Ferry's time that is the model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from math import ceil
from typing import TYPE_CHECKING

import torch

from bench.ferry import StepShape

if TYPE_CHECKING:
    from engine import EngineCore


@dataclass
class Floor:
    seconds: float
    steps: int
    tokens_computed: int

    def summary(self) -> dict[str, object]:
        return {"seconds": self.seconds, "steps": self.steps, "tokens_computed": self.tokens_computed}


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def measure_floor(engine: EngineCore, shapes: list[StepShape]) -> Floor:
    from engine import SamplingParams
    from engine.core.step import NewRequest, SchedulerOutput

    runner = engine.runner
    page_size = runner.page_size
    pool_sizes = [pool.num_pages for pool in engine.kv_cache.pools]
    sync = _synchronizer(runner.device)
    params = SamplingParams()
    # An idle step hands the runner the requests that finished last, so their rows are free for the replay.
    engine.step()
    seconds = 0.0
    previous: tuple[str, ...] = ()
    for k, shape in enumerate(shapes):
        ids = tuple(f"floor-{k}-{j}" for j in range(len(shape.num_new)))
        new_requests = []
        next_page = 0
        for request_id, computed, new in zip(ids, shape.num_computed, shape.num_new, strict=True):
            pages = ceil((computed + new) / page_size)
            # Token values do not change the cost of a forward pass; only counts, positions and pages do.
            tables = tuple(tuple((next_page + i) % size for i in range(pages)) for size in pool_sizes)
            new_requests.append(NewRequest(request_id, (0,) * (computed + new), (), params, frozenset(), 0, tables))
            next_page += pages
        plan = SchedulerOutput(
            request_ids=ids,
            num_computed_tokens=shape.num_computed,
            num_new_tokens=shape.num_new,
            token_ids=tuple([0] * new for new in shape.num_new),
            samples=shape.sampling,
            new_requests=tuple(new_requests),
            finished_ids=previous,
        )
        inputs = runner.prepare(plan)
        sync()
        start = time.perf_counter()
        runner.forward(inputs)
        sync()
        seconds += time.perf_counter() - start
        previous = ids
    runner.prepare(SchedulerOutput(finished_ids=previous))
    return Floor(seconds, len(shapes), sum(s.total_tokens for s in shapes))
