"""The server process's phases, its in-flight requests, and how it stops.

loading -> ready -> draining (SIGTERM: refuse new work with 503, let in-flight requests finish up to the drain
timeout, then exit 0). From any phase -> dead when the engine process dies: /health turns 503 at once, requests
in flight fail, and after a short linger (so probes and in-flight clients see the errors) the server exits 1
so that a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import signal
from collections.abc import Callable
from types import FrameType

import uvicorn

from server.openai.errors import service_unavailable

logger = logging.getLogger(__name__)

ENGINE_DEATH_LINGER_SECONDS = 2.0


class Phase(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"


class Lifecycle:
    def __init__(self, drain_timeout: float) -> None:
        self.drain_timeout = drain_timeout
        self.phase = Phase.LOADING
        self.exit_code = 0
        self.on_exit: Callable[[], None] = lambda: None
        """Set by whoever runs the server: stop it (uvicorn's `should_exit`)."""
        self.on_drain_timeout: Callable[[], None] = lambda: None
        """Set by the app: fail the requests still in flight when the drain runs out of time."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._drain_task: asyncio.Task[None] | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def set_ready(self) -> None:
        if self.phase is Phase.LOADING:
            self.phase = Phase.READY

    def check_accepting(self) -> None:
        """Raise the 503 that a new generation request gets outside the ready phase."""
        if self.phase is Phase.READY:
            return
        if self.phase is Phase.LOADING:
            raise service_unavailable("The model is still loading; retry shortly.", "loading")
        if self.phase is Phase.DRAINING:
            raise service_unavailable("The server is shutting down.", "draining")
        raise service_unavailable("The engine is not running.", "engine_dead")

    def request_started(self) -> None:
        self._in_flight += 1
        self._idle.clear()

    def request_finished(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    # ------------------------------------------------------------------ stopping

    def request_drain(self) -> bool:
        """Begin a graceful drain (safe from a signal handler); False if there is no loop to drain on yet."""
        if self._loop is None:
            return False
        self._loop.call_soon_threadsafe(self._start_drain)
        return True

    def _start_drain(self) -> None:
        if self._drain_task is not None or self.phase is Phase.DEAD:
            return
        self.phase = Phase.DRAINING
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        logger.info("Draining: %d request(s) in flight, waiting up to %.1fs", self._in_flight, self.drain_timeout)
        try:
            await asyncio.wait_for(self._idle.wait(), self.drain_timeout)
        except asyncio.TimeoutError:
            logger.warning("Drain timeout: failing %d request(s) still in flight", self._in_flight)
            self.on_drain_timeout()
        self.on_exit()

    def fail(self) -> None:
        """Something the server cannot run without is gone (the engine): 503 everywhere, exit 1 soon."""
        if self.phase is Phase.DEAD:
            return
        self.phase = Phase.DEAD
        self.exit_code = 1
        assert self._loop is not None
        self._loop.call_later(ENGINE_DEATH_LINGER_SECONDS, self.on_exit)


class FerryServer(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT starting a drain instead of an immediate stop.

    A second signal skips the rest of the drain; a further Ctrl-C (SIGINT) skips the rest of the shutdown too, as in
    plain uvicorn. Plain uvicorn also re-raises the signal once it has stopped (so the process dies of it); this
    handler does not record signals for that, so a drained server exits with its own status, 0.
    """

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        lifecycle.on_exit = self._stop
        self._signalled = False

    def _stop(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        logger.info("Received %s", signal.Signals(sig).name)
        if not self._signalled:
            self._signalled = True
            if self.lifecycle.request_drain():
                return
        # A SIGTERM sent twice (to the process and to its group, say) must not cut the engine's shutdown short.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True
