"""The engine process: owns the EngineCore and runs its loop; the front end talks to it over two pipes.

Loop: drain incoming messages (adds, aborts, shutdown), run one `step()` when there is work, send ONE message
per step with every request's deltas and the engine's stats. When idle it blocks on the request pipe (no
spinning) and sends a heartbeat each second so the front end can tell the loop is alive.

It exits when the front end says so, when either pipe closes (the front end died), or when its parent pid
changes; on Linux the kernel also kills it with its parent, even in the middle of loading the model.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.request import QueueFull, RequestRejected
from server.ipc import (
    AbortRequests,
    AddRequests,
    EngineFailed,
    EngineReady,
    EngineRequest,
    Heartbeat,
    Rejection,
    Shutdown,
    StepMessage,
)

if TYPE_CHECKING:
    from engine.core import EngineCore

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
# Messages handled between two steps at most, so a flood of adds cannot stall requests already running.
MAX_MESSAGES_PER_STEP = 256
_PR_SET_PDEATHSIG = 1


def run_engine_process(
    config: EngineConfig, requests: Connection, outputs: Connection, parent_pid: int, log_level: str
) -> None:
    """Entry point of the spawned process."""
    _die_with_parent(parent_pid)
    # Ctrl-C and a SIGTERM sent to the whole process group (systemd, `kill -- -pgid`) are the front end's to
    # handle: it drains in-flight requests and then shuts the engine down. Until then the engine keeps going.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s [engine] %(message)s")
    try:
        from engine.core import EngineCore  # imported here: the front end never needs torch for this module

        engine = EngineCore(config)
    except Exception:
        logger.exception("Engine failed to start")
        _report_failure(outputs)
        sys.exit(1)
    # Everything allocated so far lives for the whole process: keep the collector from rescanning it.
    gc.collect()
    gc.freeze()
    try:
        outputs.send(EngineReady(engine.max_model_len, engine.eos_token_ids, engine.model_name))
        _EngineLoop(engine, requests, outputs, parent_pid).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        logger.info("Front end went away; engine exiting")
    except Exception:
        logger.exception("Engine loop failed")
        _report_failure(outputs)
        sys.exit(1)


class _EngineLoop:
    def __init__(self, engine: EngineCore, requests: Connection, outputs: Connection, parent_pid: int) -> None:
        self.engine = engine
        self.requests = requests
        self.outputs = outputs
        self.parent_pid = parent_pid
        self.accepted: list[str] = []
        self.rejected: list[Rejection] = []

    def run(self) -> None:
        while True:
            busy = self.engine.has_unfinished()
            if self.requests.poll(0 if busy else HEARTBEAT_INTERVAL_S):
                if not self._drain_requests():
                    return
            elif not busy:
                if os.getppid() != self.parent_pid:
                    return
                self.outputs.send(Heartbeat(self.engine.stats()))
                continue
            # Pending aborts count as unfinished: their final ABORT outputs (and freed pages) come from a step.
            stepped = self.engine.has_unfinished()
            step_outputs = self.engine.step() if stepped else []
            if stepped or self.accepted or self.rejected:
                self.outputs.send(StepMessage(self.engine.stats(), step_outputs, self.accepted, self.rejected))
            self.accepted, self.rejected = [], []

    def _drain_requests(self) -> bool:
        """Handle the messages waiting on the pipe; False once told to shut down."""
        for _ in range(MAX_MESSAGES_PER_STEP):
            if not self.requests.poll(0):
                break
            message = self.requests.recv()
            if isinstance(message, AddRequests):
                for request in message.requests:
                    self._add(request)
            elif isinstance(message, AbortRequests):
                for request_id in message.request_ids:
                    self.engine.abort_request(request_id)
            elif isinstance(message, Shutdown):
                return False
            else:
                raise TypeError(f"unexpected message from the front end: {message!r}")
        return True

    def _add(self, request: EngineRequest) -> None:
        request_id = request.request_id
        try:
            self.engine.add_request(request_id, request.prompt_ids, request.params)
        except QueueFull as exc:
            self.rejected.append(Rejection(request_id, "queue_full", str(exc), "queue_full"))
        except RequestRejected as exc:
            self.rejected.append(Rejection(request_id, "invalid", str(exc), exc.code))
        except Exception as exc:
            # One bad request must not take down everyone else's: report it and keep serving.
            logger.exception("add_request(%s) failed", request_id)
            self.rejected.append(Rejection(request_id, "internal", f"{type(exc).__name__}: {exc}", "internal_error"))
        else:
            self.accepted.append(request_id)


def _die_with_parent(parent_pid: int) -> None:
    """Have Linux SIGKILL this process when its parent dies (a no-op elsewhere; pipe EOF covers the rest)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the request above took effect
        sys.exit(0)


def _report_failure(outputs: Connection) -> None:
    with contextlib.suppress(OSError):
        outputs.send(EngineFailed(traceback.format_exc()))
