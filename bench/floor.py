"""The model floor: the forward passes Ferry ran, replayed with nothing else around them.

Each recorded step shape (per sequence: tokens already cached, tokens computed now, whether its logits are
needed) is rebuilt as fresh requests over synthetic block tables, packed by the runner outside the timer, and
only `runner.run` (the forward pass plus logits at the last tokens) is timed. No scheduling, no batch assembly,
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
    from engine.request import Request

    runner = engine.runner
    page_size = runner.page_size
    pool_sizes = [manager.num_blocks for manager in engine.block_manager.managers]
    sync = _synchronizer(runner.device)
    params = SamplingParams()
    longest = max((c + n for s in shapes for c, n in zip(s.num_computed, s.num_new, strict=True)), default=0)
    # Token values do not change the cost of a forward pass; only counts, positions and pages do.
    zeros = [0] * longest
    seconds = 0.0
    for shape in shapes:
        requests = []
        tables: list[list[list[int]]] = [[] for _ in pool_sizes]
        next_page = 0
        for j, (computed, new) in enumerate(zip(shape.num_computed, shape.num_new, strict=True)):
            request = Request(f"floor-{j}", zeros[: computed + new], params, frozenset())
            request.num_computed_tokens = computed
            requests.append(request)
            pages = ceil((computed + new) / page_size)
            for group_tables, num_blocks in zip(tables, pool_sizes, strict=True):
                group_tables.append([(next_page + k) % num_blocks for k in range(pages)])
            next_page += pages
        inputs = runner.prepare(requests, list(shape.num_new), tables, list(shape.sampling))
        sync()
        start = time.perf_counter()
        runner.run(inputs)
        sync()
        seconds += time.perf_counter() - start
    return Floor(seconds, len(shapes), sum(s.total_tokens for s in shapes))
