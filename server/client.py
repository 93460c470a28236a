"""EngineClient: the front end's handle on the engine process.

It spawns the process (spawn, not fork: the engine must not inherit the server's threads and sockets), waits
for the model to load, sends adds and aborts, and reads each step message on the asyncio loop as the output pipe
becomes readable (no reader thread: a token reaches its stream without a hand-over between threads, which cost a
thread wake-up, the GIL and the loop's self-pipe for every message). Each API call's engine requests form a
`RequestGroup` whose deltas arrive on one asyncio queue.
The process sentinel and the pipe's EOF both reveal the engine's death, which fails every request in flight.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import multiprocessing
import os
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.core.driver import AbortRequests, AddRequests, EngineRequest, Heartbeat, Rejection, Shutdown, StepMessage
from engine.core.request import QueueFull, RequestRejected, StepOutput
from server.engine_process import run_engine_process
from server.ipc import EngineFailed, EngineReady
from server.settings import LogFormat

if TYPE_CHECKING:
    from engine.core.stats import EngineStats

logger = logging.getLogger(__name__)

# Health: an engine loop that has sent nothing (no step, no idle heartbeat) for this long is stuck. Generous,
# because one step of a big prefill on a CPU can legitimately take many seconds.
ENGINE_STALL_SECONDS = 60.0

StatsCallback = Callable[["EngineStats"], None]
"""Called with the engine's stats from every step message and idle heartbeat."""


class EngineDeadError(RuntimeError):
    """The engine process is gone (or going); requests in flight fail with it."""


class EngineAddFailed(RuntimeError):
    """The engine raised something unexpected while adding a request (a bug, not the request's fault)."""


class RequestGroup:
    """The engine requests behind one API call (n choices of one or more prompts).

    Their deltas arrive, tagged with the request's index, on one queue that the HTTP handler consumes.
    A failure (engine death, timeout, shutdown) is put on the same queue and raised by `get()`.
    """

    def __init__(self, client: EngineClient, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self._client = client
        self._index = {request_id: i for i, request_id in enumerate(request_ids)}
        self._queue: asyncio.Queue[tuple[int, StepOutput, float] | BaseException] = asyncio.Queue()
        self._awaiting_admission = set(request_ids)
        self._admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._unfinished = set(request_ids)
        self._failure: BaseException | None = None

    async def wait_admitted(self) -> None:
        """Return once the engine accepted every request; raise RequestRejected, QueueFull or the failure."""
        await self._admitted

    async def get(self) -> tuple[int, StepOutput, float]:
        """The next delta: (request index, output, monotonic time it reached the front end)."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def abort(self, index: int) -> None:
        """Stop one request early (a stop string ended it); idempotent."""
        request_id = self.request_ids[index]
        if request_id in self._unfinished:
            self._unfinished.discard(request_id)
            self._client._abort([request_id])

    def fail(self, error: BaseException) -> None:
        """End every pending wait on this group with `error` and stop its requests in the engine."""
        if self._failure is not None:
            return
        self._failure = error
        if not self._admitted.done():
            self._admitted.set_exception(error)
        self._queue.put_nowait(error)
        self.close()

    def close(self) -> None:
        """Abort whatever is still running (client gone, response done); idempotent."""
        if self._unfinished:
            self._client._abort(list(self._unfinished))
            self._unfinished.clear()
        if self._admitted.done() and not self._admitted.cancelled():
            self._admitted.exception()  # mark retrieved: nobody may be waiting any more

    def _on_accepted(self, request_id: str) -> None:
        self._awaiting_admission.discard(request_id)
        if not self._awaiting_admission and not self._admitted.done():
            self._admitted.set_result(None)

    def _on_rejected(self, rejection: Rejection) -> None:
        self._unfinished.discard(rejection.request_id)
        if self._admitted.done():
            return
        if rejection.kind == "queue_full":
            self._admitted.set_exception(QueueFull(rejection.message))
        elif rejection.kind == "invalid":
            self._admitted.set_exception(RequestRejected(rejection.message, code=rejection.code))
        else:
            self._admitted.set_exception(EngineAddFailed(rejection.message))

    def _on_output(self, output: StepOutput, received: float) -> None:
        if output.finished:
            self._unfinished.discard(output.request_id)
        self._queue.put_nowait((self._index[output.request_id], output, received))


class EngineProcess:
    """The spawned engine process and the front end's ends of its two pipes."""

    def __init__(self, process: BaseProcess, requests: Connection, outputs: Connection) -> None:
        self.process = process
        self.requests = requests
        """Adds, aborts and the shutdown go down this pipe."""
        self.outputs = outputs
        """The ready message, step messages and heartbeats come up this one."""

    @classmethod
    def spawn(
        cls, config: EngineConfig, *, log_level: str, log_format: LogFormat, step_log: str | None
    ) -> EngineProcess:
        """Spawn the engine process; it starts loading the model at once. Needs no event loop, but must be called
        from the thread that runs the server: Linux's parent-death signal fires when the *thread* that spawned the
        child exits, so a short-lived worker thread must not do this."""
        context = multiprocessing.get_context("spawn")
        request_reader, request_writer = context.Pipe(duplex=False)
        output_reader, output_writer = context.Pipe(duplex=False)
        process = context.Process(
            target=run_engine_process,
            args=(config, request_reader, output_writer, os.getpid(), log_level, log_format, step_log),
            name="ferry-engine",
        )
        process.start()
        # Keep only our ends: once the child exits, its ends close and our reads see EOF at once.
        request_reader.close()
        output_writer.close()
        engine = cls(process, request_writer, output_reader)
        # If this interpreter exits without a shutdown, multiprocessing's exit hook would join the child, which
        # ignores SIGTERM and still sees our open pipes: kill it first (hooks run last-registered first).
        atexit.register(engine.kill)
        return engine

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class EngineClient:
    def __init__(
        self,
        config: EngineConfig,
        *,
        log_level: str = "info",
        log_format: LogFormat = "text",
        step_log: str | None = None,
        on_stats: StatsCallback | None = None,
        on_death: Callable[[], None] | None = None,
        engine: EngineProcess | None = None,
    ) -> None:
        """`engine`: the engine process, where it was spawned before the front end (`ferry serve` does, so that the
        model loads while the web stack imports); otherwise `start()` spawns it."""
        self.config = config
        self.info: EngineReady | None = None
        self._log_level = log_level
        self._log_format = log_format
        self._step_log = step_log
        self._on_stats = on_stats
        self._on_death = on_death
        self._routes: dict[str, RequestGroup] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reading = False
        """Whether the loop watches the output pipe (from `wait_ready` until its end or the shutdown)."""
        self._ready: asyncio.Future[EngineReady] | None = None
        self._last_message = time.monotonic()
        self._failure: str | None = None
        self._dead = False
        self._closing = False
        self._engine = engine

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Attach to the running event loop, spawning the engine process first unless it was handed in (it starts
        loading the model at once); then await `wait_ready()`."""
        if self._engine is None:
            self._engine = EngineProcess.spawn(
                self.config, log_level=self._log_level, log_format=self._log_format, step_log=self._step_log
            )
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._loop.add_reader(self._engine.process.sentinel, self._on_process_exit)

    async def wait_ready(self) -> EngineReady:
        """Wait until the engine's model is loaded; raise EngineDeadError if the process dies first."""
        assert self._ready is not None and self._loop is not None and self._engine is not None, "start() first"
        self._loop.add_reader(self._engine.outputs.fileno(), self._read_outputs)
        self._reading = True
        return await self._ready

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the engine to exit, then make sure it has (killing it after `timeout`)."""
        self._closing = True
        engine = self._engine
        if engine is None:
            return
        process = engine.process
        if process.is_alive():
            with contextlib.suppress(EngineDeadError):
                self._send(Shutdown())
            await asyncio.to_thread(process.join, timeout)
        engine.kill()
        self._fail_all(EngineDeadError("The server is shutting down."))
        if self._loop is not None:
            self._loop.remove_reader(process.sentinel)
        engine.requests.close()
        self._stop_reading()
        engine.outputs.close()
        atexit.unregister(engine.kill)

    # ---------------------------------------------------------------- state

    @property
    def alive(self) -> bool:
        return self._engine is not None and not self._dead and self._engine.process.is_alive()

    @property
    def healthy(self) -> bool:
        """Alive, and (once loaded) its loop made progress recently."""
        if not self.alive:
            return False
        return self.info is None or time.monotonic() - self._last_message < ENGINE_STALL_SECONDS

    # ---------------------------------------------------------------- requests

    def submit(self, requests: list[EngineRequest]) -> RequestGroup:
        """Send requests to the engine; await `wait_admitted()` on the result to learn whether it took them."""
        if self._dead or self.info is None:
            raise EngineDeadError("The engine is not running.")
        group = RequestGroup(self, [r.request_id for r in requests])
        for request in requests:
            self._routes[request.request_id] = group
        try:
            self._send(AddRequests(requests))
        except EngineDeadError:
            for request in requests:
                self._routes.pop(request.request_id, None)
            raise
        return group

    def fail_all(self, error: BaseException) -> None:
        """End every request in flight with `error` (used when a drain runs out of time)."""
        self._fail_all(error)

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._routes.pop(request_id, None)
        if self.alive:
            # If it died meanwhile, its death is being handled and there is nothing left to abort.
            with contextlib.suppress(EngineDeadError):
                self._send(AbortRequests(request_ids))

    def _send(self, message: object) -> None:
        if self._engine is None or self._dead:
            raise EngineDeadError("The engine is not running.")
        try:
            self._engine.requests.send(message)
        except OSError as exc:
            raise EngineDeadError("The engine process is gone.") from exc

    def _fail_all(self, error: BaseException) -> None:
        for group in {id(g): g for g in self._routes.values()}.values():
            group.fail(error)
        self._routes.clear()

    # ---------------------------------------------------------------- engine -> front end

    def _read_outputs(self) -> None:
        """The output pipe is readable: handle its next message. One a call: while more wait, the pipe stays
        readable and the loop calls again (asking the pipe with `poll` built a selector each time). A message is
        written in one go, so a read that finds its start waits at most for the writer to finish it. At the pipe's
        end the process is gone."""
        assert self._engine is not None
        try:
            message = self._engine.outputs.recv()
        except (EOFError, OSError):
            self._stop_reading()
            self._on_process_exit()
            return
        self._last_message = time.monotonic()
        self._handle(message)

    def _stop_reading(self) -> None:
        if self._reading:
            assert self._engine is not None and self._loop is not None
            self._reading = False
            self._loop.remove_reader(self._engine.outputs.fileno())

    def _handle(self, message: object) -> None:
        if isinstance(message, StepMessage):
            self._handle_step(message)
        elif isinstance(message, Heartbeat):
            if self._on_stats is not None:
                self._on_stats(message.stats)
        elif isinstance(message, EngineReady):
            self.info = message
            self._last_message = time.monotonic()
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(message)
        elif isinstance(message, EngineFailed):
            self._failure = message.message  # the engine logged the traceback itself; its gist goes in the death

    def _handle_step(self, message: StepMessage) -> None:
        received = time.monotonic()
        for request_id in message.accepted:
            group = self._routes.get(request_id)
            if group is not None:
                group._on_accepted(request_id)
        for rejection in message.rejected:
            group = self._routes.pop(rejection.request_id, None)
            if group is not None:
                group._on_rejected(rejection)
        for output in message.outputs:
            group = self._routes.get(output.request_id)
            if group is None:
                continue  # aborted or failed on our side already
            if output.finished:
                del self._routes[output.request_id]
            group._on_output(output, received)
        if self._on_stats is not None:
            self._on_stats(message.stats)

    def _on_process_exit(self) -> None:
        assert self._engine is not None and self._loop is not None
        process, outputs = self._engine.process, self._engine.outputs
        # The sentinel stays readable once the process is gone, and so does the pipe at its end: stop watching both
        # before anything else.
        self._loop.remove_reader(process.sentinel)
        self._stop_reading()
        if self._dead or self._closing:
            return
        self._dead = True
        # What the engine said before dying (`EngineFailed`) is the reason: read it all first, up to the pipe's end,
        # which the dead process has closed.
        with contextlib.suppress(EOFError, OSError):
            while outputs.poll(0):
                self._handle(outputs.recv())
        # The sentinel fires as the process closes its files, a moment before it can be reaped.
        process.join(timeout=1.0)
        exitcode = process.exitcode
        reason = f"The engine process died (exit code {exitcode})."
        if self._failure:
            reason += " " + self._failure.strip().splitlines()[-1]
        logger.error("%s", reason)
        error = EngineDeadError(reason)
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(error)
        self._fail_all(error)
        if self._on_death is not None:
            self._on_death()
