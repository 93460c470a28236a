"""In-process drivers of the engine step, shaped like transformers' continuous-batching API.

`generate_batch` runs the step loop in the calling thread until every input finished. `ContinuousBatchingManager`
runs it in a background thread, takes requests from any thread, and hands results back by polling, by iteration,
by streaming per request, or through callbacks scheduled on an asyncio loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from functools import partial

from tqdm import tqdm

from engine.config import EngineConfig
from engine.core.driver import (
    AbortRequests,
    AddRequests,
    EngineInput,
    EngineLoop,
    EngineOutput,
    EngineRequest,
    Shutdown,
    StepMessage,
)
from engine.core.engine_core import EngineCore
from engine.core.request import (
    FinishReason,
    GenerationOutput,
    LoRARequest,
    PoolingParams,
    RequestRejected,
    SamplingParams,
    StepOutput,
)
from engine.multimodal.inputs import ImageInput

logger = logging.getLogger(__name__)


def generate_batch(
    inputs: list[list[int]],
    config: EngineConfig | None = None,
    *,
    params: SamplingParams | list[SamplingParams] | None = None,
    engine: EngineCore | None = None,
    progress_bar: bool = False,
    loras: list[LoRARequest | None] | None = None,
    images: list[Sequence[ImageInput]] | None = None,
) -> dict[str, GenerationOutput]:
    """Generate for every prompt and block until all finish; ids are `req_0`, `req_1`, ... in input order.
    `loras`: per prompt, the LoRA adapter it runs with (None: the base model; needs --enable-lora's option).
    `images`: per prompt, the processed images among its tokens (an image model's; engine/multimodal/).

    Raises `RequestRejected` for a prompt the engine can never serve (too long, empty, ids out of range).
    """
    if engine is None:
        if config is None:
            raise ValueError("generate_batch needs an EngineConfig or an EngineCore")
        engine = EngineCore(config)
    if params is None:
        params = SamplingParams()
    per_request = params if isinstance(params, list) else [params] * len(inputs)
    if len(per_request) != len(inputs):
        raise ValueError(f"{len(per_request)} SamplingParams for {len(inputs)} inputs")
    adapters = loras if loras is not None else [None] * len(inputs)
    if len(adapters) != len(inputs):
        raise ValueError(f"{len(adapters)} LoRA adapters for {len(inputs)} inputs")
    pictures = images if images is not None else [()] * len(inputs)
    if len(pictures) != len(inputs):
        raise ValueError(f"{len(pictures)} image lists for {len(inputs)} inputs")
    requests = [
        EngineRequest(f"req_{i}", list(ids), p, lora=lora, images=tuple(pics))
        for i, (ids, p, lora, pics) in enumerate(zip(inputs, per_request, adapters, pictures, strict=True))
    ]
    with tqdm(total=len(inputs), disable=not progress_bar, desc="generate_batch") as bar:
        batch = _Batch(engine, requests, bar)
        batch.run()
    return batch.results


def pool_batch(
    inputs: list[list[int]],
    config: EngineConfig | None = None,
    *,
    engine: EngineCore | None = None,
    token_type_ids: list[list[int]] | None = None,
) -> list[list[float]]:
    """Pool every input (embeddings, or a classifier's or reranker's scores: what the model's pooler makes,
    engine/pooling/) and block until all are done; the vectors in input order. `token_type_ids`, per input, its
    tokens' segments (a BERT pair's second text is 1). Raises `RequestRejected` for an input the engine can never
    serve, and for a model that does not pool."""
    if engine is None:
        if config is None:
            raise ValueError("pool_batch needs an EngineConfig or an EngineCore")
        engine = EngineCore(config)
    types = token_type_ids if token_type_ids is not None else [[] for _ in inputs]
    if len(types) != len(inputs):
        raise ValueError(f"{len(types)} token type lists for {len(inputs)} inputs")
    requests = [
        EngineRequest(f"req_{i}", list(ids), SamplingParams(max_new_tokens=1), pooling=PoolingParams(tuple(t)))
        for i, (ids, t) in enumerate(zip(inputs, types, strict=True))
    ]
    batch = _Batch(engine, requests, tqdm(total=len(inputs), disable=True))
    batch.run()
    results = [batch.results[request.request_id] for request in requests]
    for result in results:
        if result.pooled is None:
            raise RuntimeError(f"request {result.request_id} finished without a vector: {result.error}")
    return [result.pooled for result in results]  # type: ignore[misc]


class _Batch:
    """generate_batch's inbox and outbox: feeds requests as the waiting queue has room, stops when all finished."""

    def __init__(self, engine: EngineCore, requests: list[EngineRequest], bar: tqdm) -> None:
        self.engine = engine
        self.pending = deque(requests)
        self.results = {r.request_id: GenerationOutput(r.request_id, list(r.prompt_ids)) for r in requests}
        self.num_finished = 0
        self.bar = bar

    def run(self) -> None:
        """Until every request finished. A rejection raises (RequestRejected) as soon as it is answered, which may
        be before the step that runs the batch's other requests: those are ended first, so the engine is left
        without them for the next call."""
        try:
            EngineLoop(self.engine, self, self.publish).run()
        except BaseException:
            for request_id, output in self.results.items():
                if not output.finished:
                    self.engine.abort_request(request_id)
            while self.engine.has_unfinished():
                self.engine.step()
            raise

    def receive(self, timeout: float, limit: int) -> list[EngineInput]:
        if self.num_finished == len(self.results):
            return [Shutdown()]
        room = self.engine.queue_room()
        count = len(self.pending) if room is None else min(room, len(self.pending))
        return [AddRequests([self.pending.popleft() for _ in range(count)])] if count else []

    def publish(self, message: EngineOutput) -> None:
        if not isinstance(message, StepMessage):
            return
        for rejection in message.rejected:
            if rejection.kind == "invalid":
                raise RequestRejected(rejection.message, code=rejection.code)
            raise RuntimeError(f"request {rejection.request_id} could not be added: {rejection.message}")
        for delta in message.outputs:
            output = self.results[delta.request_id]
            output.merge(delta)
            if output.finished:
                self.num_finished += 1
                self.bar.update(1)


def _has_news(output: GenerationOutput, seen: int) -> bool:
    return len(output.generated_ids) > seen or output.finished


class ManagerStopped(RuntimeError):
    """The manager no longer accepts requests."""


class ContinuousBatchingManager:
    """Runs `EngineCore.step()` in a background thread; thread-safe front door for requests and results."""

    def __init__(self, engine_or_config: EngineCore | EngineConfig) -> None:
        self._owns_engine = not isinstance(engine_or_config, EngineCore)
        """An engine it built from a config is its to close (stopping its tensor-parallel ranks) once it stops."""
        self.engine = engine_or_config if isinstance(engine_or_config, EngineCore) else EngineCore(engine_or_config)
        self._inbox: queue.SimpleQueue[EngineInput] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._lock = threading.Condition()
        self._outputs: dict[str, GenerationOutput] = {}
        self._finished: queue.Queue[str] = queue.Queue()  # ids, in the order their requests finished
        self._handlers: dict[str, tuple[asyncio.AbstractEventLoop, Callable[[GenerationOutput], object]]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._pause_requests = 0
        self._paused = threading.Event()
        self.error: BaseException | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._accepting = True
        self._thread = threading.Thread(target=self._loop, name="ferry-engine", daemon=True)
        self._thread.start()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, block: bool = True, timeout: float | None = None, hard_stop: bool = False) -> None:
        """Stop accepting requests. Graceful: in-flight requests finish first. Hard: they end now with an error."""
        self._accepting = False
        if hard_stop:
            with self._lock:
                live = [rid for rid, out in self._outputs.items() if not out.finished]
            error = "the manager was stopped (hard stop) before the request finished"
            self._inbox.put(AbortRequests(live, error))
        self._inbox.put(Shutdown(drain=True))
        self._wakeup.set()
        if block and self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> ContinuousBatchingManager:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop(block=True)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Hold the loop between steps; requests added meanwhile are kept and run after the block."""
        with self._lock:
            self._pause_requests += 1
        self._wakeup.set()
        try:
            if self.is_running():
                self._paused.wait()
            yield
        finally:
            with self._lock:
                self._pause_requests -= 1
            self._wakeup.set()

    # -- requests in -----------------------------------------------------------------------------------------

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        if not self._accepting:
            raise ManagerStopped("the manager is not running: call start() (or use it as a context manager)")
        request_id = request_id if request_id is not None else f"req_{next(self._ids)}"
        with self._lock:
            if request_id in self._outputs:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self._outputs[request_id] = GenerationOutput(request_id, list(prompt_ids))
        self._inbox.put(AddRequests([EngineRequest(request_id, list(prompt_ids), params or SamplingParams())]))
        self._wakeup.set()
        return request_id

    def add_requests(
        self, inputs: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[str]:
        per_request = params if isinstance(params, list) else [params] * len(inputs)
        return [self.add_request(ids, p) for ids, p in zip(inputs, per_request, strict=True)]

    def cancel_request(self, request_id: str) -> None:
        self._inbox.put(AbortRequests([request_id]))
        self._wakeup.set()

    # -- results out -----------------------------------------------------------------------------------------

    def register_result_handler(self, request_id: str, callback: Callable[[GenerationOutput], object]) -> None:
        """Call `callback(output)` on the caller's asyncio loop after every step that changes the request."""
        loop = asyncio.get_running_loop()
        with self._lock:
            self._handlers[request_id] = (loop, callback)

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next finished result (any request), or the given request's once it finished; None on timeout.

        A result is handed out once, by either form; the manager then forgets it, so a long-running manager does
        not accumulate every output it ever produced.
        """
        if request_id is None:
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    finished_id = self._finished.get(timeout=remaining)
                except queue.Empty:
                    return None
                with self._lock:
                    result = self._outputs.pop(finished_id, None)
                if result is not None:  # None: already handed out by get_result(request_id)
                    return result
        with self._lock:
            if request_id not in self._outputs:
                raise KeyError(f"unknown (or already handed out) request id {request_id!r}")
            if not self._lock.wait_for(lambda: self._outputs[request_id].finished, timeout):
                return None
            return self._outputs.pop(request_id)

    def request_id_iter(self, request_id: str) -> Iterator[GenerationOutput]:
        """Yield snapshots of a request's output as it grows; the last one is final."""
        seen = -1
        while True:
            with self._lock:
                if request_id not in self._outputs:
                    raise KeyError(f"unknown request id {request_id!r}")
                output = self._outputs[request_id]
                self._lock.wait_for(partial(_has_news, output, seen))
                seen = len(output.generated_ids)
                snapshot = copy.deepcopy(output)
            yield snapshot
            if snapshot.finished:
                return

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Finished results as they come, until the manager stopped and everything was handed out."""
        while True:
            result = self.get_result(timeout=0.05)
            if result is not None:
                yield result
            elif not self.is_running() and self._finished.empty():
                return

    # -- the loop --------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            EngineLoop(self.engine, self, self._on_message).run()
        except BaseException as exc:
            logger.exception("engine loop failed")
            self.error = exc
            with self._lock:
                live = [rid for rid, out in self._outputs.items() if not out.finished]
            self._publish([StepOutput(rid, [], FinishReason.ABORT, error=f"engine failure: {exc!r}") for rid in live])
        finally:
            self._paused.set()
            self._accepting = False
            if self._owns_engine:
                self.engine.close()

    def receive(self, timeout: float, limit: int) -> list[EngineInput]:
        """The loop's inbox: holds the loop here while paused, between two steps."""
        while self._pause_requests:
            self._paused.set()
            self._wakeup.wait(0.1)
            self._wakeup.clear()
            self.engine.keep_alive()  # a pause may outlast the tensor-parallel ranks' patience
        self._paused.clear()
        messages = self._take(limit)
        if not messages and timeout:
            self._wakeup.wait(timeout)
            self._wakeup.clear()
            messages = self._take(limit)
        return messages

    def _take(self, limit: int) -> list[EngineInput]:
        messages: list[EngineInput] = []
        while len(messages) < limit:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        return messages

    def _on_message(self, message: EngineOutput) -> None:
        if isinstance(message, StepMessage):
            rejected = [StepOutput(r.request_id, [], FinishReason.ABORT, error=r.message) for r in message.rejected]
            self._publish(rejected + message.outputs)

    def _publish(self, deltas: list[StepOutput]) -> None:
        callbacks = []
        with self._lock:
            for delta in deltas:
                output = self._outputs.get(delta.request_id)
                if output is None or output.finished:
                    continue
                output.merge(delta)
                handler = self._handlers.get(delta.request_id)
                if handler is not None:
                    callbacks.append((handler, copy.deepcopy(output)))
                if output.finished:
                    self._handlers.pop(delta.request_id, None)
                    self._finished.put(delta.request_id)
            self._lock.notify_all()
        for (loop, callback), snapshot in callbacks:
            loop.call_soon_threadsafe(callback, snapshot)
