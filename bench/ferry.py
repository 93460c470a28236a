"""Ferry's side of the offline benchmark: the engine step loop over a workload, recording what each step ran.

The loop is `generate_batch`'s own (add every request, call `EngineCore.step()` until done), written out here so
that each request's admission (arrival + `queue_seconds`) and finish (the step that emitted its last token) can be
dated for the timeline, and so that each step's batch shape can be kept for the model-floor replay.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bench.models import BenchModel
from bench.results import RequestTrace, SystemRun
from bench.workload import Workload

if TYPE_CHECKING:
    from engine import EngineCore
    from engine.request import Request
    from engine.runner import StepInputs


@dataclass(frozen=True)
class StepShape:
    """One packed forward pass: per sequence, tokens already in the cache and tokens computed now."""

    num_computed: tuple[int, ...]
    num_new: tuple[int, ...]
    sampling: tuple[bool, ...]
    """Whether the sequence's last token is in this step (its logits are computed)."""

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new)


def build_engine(
    model: BenchModel, workload: Workload, *, slots: int, max_batch_tokens: int, page_size: int
) -> EngineCore:
    from engine import EngineConfig, EngineCore

    config = EngineConfig(
        model=str(model.path),
        load_format="auto" if model.has_weights else "dummy",
        dtype=model.dtype_name,
        device=str(model.device),
        page_size=page_size,
        num_blocks=workload.cache_pages(slots, page_size),
        max_batch_tokens=max_batch_tokens,
        max_num_seqs=slots,
        max_queue_size=0,
        cpu_threads=None,  # every system runs with the thread count --threads set
    )
    return EngineCore(config)


class _ShapeRecorder:
    """Wraps `runner.prepare` to keep each step's batch shape; a few list copies per step, nothing per token."""

    def __init__(self, engine: EngineCore) -> None:
        self.shapes: list[StepShape] = []
        self._engine = engine
        self._prepare = engine.runner.prepare

    def __enter__(self) -> _ShapeRecorder:
        def prepare(
            requests: list[Request],
            num_new_tokens: list[int],
            block_tables: list[list[list[int]]],
            sampling: list[bool],
        ) -> StepInputs:
            self.shapes.append(
                StepShape(tuple(r.num_computed_tokens for r in requests), tuple(num_new_tokens), tuple(sampling))
            )
            return self._prepare(requests, num_new_tokens, block_tables, sampling)

        self._engine.runner.prepare = prepare  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc_info: object) -> None:
        del self._engine.runner.prepare  # the instance attribute goes, the class method shows through again


def run_ferry(
    engine: EngineCore, workload: Workload, *, record_shapes: bool = False
) -> tuple[SystemRun, list[StepShape]]:
    from engine import SamplingParams

    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in workload.output_lens]
    tokens: list[list[int]] = [[] for _ in range(len(workload))]
    submitted = [0.0] * len(workload)
    admitted = [0.0] * len(workload)
    finished = [0.0] * len(workload)
    recorder = _ShapeRecorder(engine) if record_shapes else None
    before = engine.stats()
    with recorder or contextlib.nullcontext():
        start = time.perf_counter()
        for i, prompt in enumerate(workload.prompts):
            submitted[i] = time.perf_counter() - start
            engine.add_request(str(i), prompt, params[i])
        while engine.has_unfinished():
            outputs = engine.step()
            now = time.perf_counter() - start
            for out in outputs:
                i = int(out.request_id)
                if out.error is not None:
                    raise RuntimeError(f"Ferry request {i} failed: {out.error}")
                tokens[i].extend(out.new_token_ids)
                if out.queue_seconds is not None:
                    admitted[i] = submitted[i] + out.queue_seconds
                if out.finished:
                    finished[i] = now
        wall = time.perf_counter() - start
    stats = engine.stats()
    traces = [RequestTrace(i, admitted[i], finished[i], finished[i]) for i in range(len(workload))]
    details = {
        "max_num_seqs": engine.config.max_num_seqs,
        "max_batch_tokens": engine.config.max_batch_tokens,
        "page_size": engine.config.page_size,
        "num_blocks": stats.num_blocks,
        # The engine's counters are cumulative; a warm-up run may have gone through the same engine.
        "steps": stats.num_steps - before.num_steps,
        "preemptions": stats.num_preemptions - before.num_preemptions,
        "prefix_cache_hits": stats.prefix_cache_hits - before.prefix_cache_hits,
        "prefix_cache_queries": stats.prefix_cache_queries - before.prefix_cache_queries,
    }
    return SystemRun("ferry", wall, tokens, traces, details), recorder.shapes if recorder is not None else []
