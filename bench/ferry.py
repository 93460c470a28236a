"""Ferry's side of the offline benchmark: `generate_batch` over a workload, with a step observer that dates each
request's admission (`queue_seconds`) and finish (the step that emitted its last token) for the timeline, and
keeps each step's batch shape for the model-floor replay.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bench.models import BenchModel
from bench.results import RequestTrace, SystemRun
from bench.workload import Workload
from engine.config import CompileLevel

if TYPE_CHECKING:
    from engine import EngineCore
    from engine.core.observer import StepRecord


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep what exists now out of the collector's passes while the block runs, as the engine process does after
    start-up (server/engine_process.py): a measured step then pays for its own garbage, not for rescanning the
    model and the libraries whenever a full collection falls into it (0.3 s each, at random steps)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


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
    model: BenchModel,
    workload: Workload,
    *,
    slots: int,
    max_batch_tokens: int,
    page_size: int,
    attention_backend: str = "auto",
    async_scheduling: bool = False,
    compile: CompileLevel = "none",
    enforce_eager: bool = False,
    quantization: str = "none",
    model_impl: str = "auto",
    cpu_threads: int | None = None,
) -> EngineCore:
    """`model_impl="transformers"`: the transformers fallback (the `ferry-fallback` system), for families that
    also have native modules. `cpu_threads` None keeps the torch threads `--threads` set; 0 is the engine's own
    default (decode threads that follow the load)."""
    from engine import EngineConfig, EngineCore

    config = EngineConfig.of(
        model=str(model.path),
        load_format="auto" if model.has_weights else "dummy",
        dtype=model.dtype_name,
        device=str(model.device),
        page_size=page_size,
        attention_backend=attention_backend,
        num_pages=workload.cache_pages(slots, page_size),
        max_batch_tokens=max_batch_tokens,
        max_num_seqs=slots,
        max_queue_size=0,
        cpu_threads=cpu_threads,
        async_scheduling=async_scheduling,
        compile=compile,
        enforce_eager=enforce_eager,
        quantization=quantization,
        model_impl=model_impl,
    )
    return EngineCore(config)


class _Recorder:
    """A step observer: when each request was admitted and finished, and (optionally) each step's shape."""

    def __init__(self, num_requests: int, record_shapes: bool) -> None:
        self.start = time.perf_counter()
        self.admitted = [0.0] * num_requests
        self.finished = [0.0] * num_requests
        self.shapes: list[StepShape] = []
        self._record_shapes = record_shapes

    def on_step(self, record: StepRecord) -> None:
        now = time.perf_counter() - self.start
        plan = record.plan
        if self._record_shapes and plan.request_ids:
            self.shapes.append(StepShape(plan.num_computed_tokens, plan.num_new_tokens, plan.samples))
        for out in record.outputs:
            i = _index(out.request_id)
            if out.queue_seconds is not None:
                self.admitted[i] = out.queue_seconds  # every request is submitted at the start
            if out.finished:
                self.finished[i] = now


def _index(request_id: str) -> int:
    return int(request_id.removeprefix("req_"))


def run_ferry(
    engine: EngineCore, workload: Workload, *, record_shapes: bool = False, system: str = "ferry"
) -> tuple[SystemRun, list[StepShape]]:
    from engine import SamplingParams, generate_batch

    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in workload.output_lens]
    recorder = _Recorder(len(workload), record_shapes)
    before = engine.stats()
    engine.observers.append(recorder)
    try:
        with frozen_heap():
            recorder.start = time.perf_counter()
            results = generate_batch(workload.prompts, params=params, engine=engine)
            wall = time.perf_counter() - recorder.start
    finally:
        engine.observers.remove(recorder)
    tokens: list[list[int]] = [[] for _ in range(len(workload))]
    for request_id, result in results.items():
        if result.error is not None:
            raise RuntimeError(f"Ferry request {request_id} failed: {result.error}")
        tokens[_index(request_id)] = result.generated_ids
    stats = engine.stats()
    traces = [RequestTrace(i, recorder.admitted[i], done, done) for i, done in enumerate(recorder.finished)]
    details = {
        "max_num_seqs": engine.config.scheduler.max_num_seqs,
        "max_batch_tokens": engine.config.scheduler.max_batch_tokens,
        "page_size": engine.config.cache.page_size,
        "attention_backend": engine.runner.backend.name,
        "num_pages": stats.num_pages,
        # The engine's counters are cumulative; a warm-up run may have gone through the same engine.
        "steps": stats.num_steps - before.num_steps,
        "preemptions": stats.num_preemptions - before.num_preemptions,
        "prefix_cache_hits": stats.prefix_cache_hits - before.prefix_cache_hits,
        "prefix_cache_queries": stats.prefix_cache_queries - before.prefix_cache_queries,
    }
    return SystemRun(system, wall, tokens, traces, details), recorder.shapes
