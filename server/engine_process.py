"""The engine process: owns the EngineCore and runs the engine's own loop (`engine.core.driver.EngineLoop`) with the
request pipe as its inbox and the output pipe as its outbox. When idle the loop blocks on the request pipe (no
spinning) and a heartbeat goes out each second so the front end can tell the loop is alive.

It exits when the front end says so, when either pipe closes (the front end died), or when its parent pid
changes; on Linux the kernel also kills it with its parent, even in the middle of loading the model.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import select
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

from engine.config import EngineConfig, EngineStartupError
from engine.core.driver import EngineInput, EngineLoop, Shutdown
from engine.core.step_log import StepLog
from engine.distributed.lifetime import die_with_parent
from server.collector import paused_collector
from server.ipc import EngineFailed, EngineReady
from server.logs import configure_logging
from server.settings import LogFormat

logger = logging.getLogger(__name__)


def run_engine_process(
    config: EngineConfig,
    requests: Connection,
    outputs: Connection,
    parent_pid: int,
    log_level: str,
    log_format: LogFormat,
    step_log: str | None,
) -> None:
    """Entry point of the spawned process; `step_log`: a file for engine.core.step_log's lines."""
    die_with_parent(parent_pid)
    # Ctrl-C and a SIGTERM sent to the whole process group (systemd, `kill -- -pgid`) are the front end's to
    # handle: it drains in-flight requests and then shuts the engine down. Until then the engine keeps going.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(log_level, log_format, label="engine")
    try:
        with paused_collector():
            from engine.core.engine_core import EngineCore  # imported here: the front end never needs torch

        engine = EngineCore(config, observers=[StepLog(Path(step_log))] if step_log else ())
    except EngineStartupError as exc:
        # A refusal by name (the model, or the options on this machine): its message is the whole story.
        logger.error("Cannot serve this model: %s", exc)
        _report_failure(outputs, f"{type(exc).__name__}: {exc}")
        sys.exit(1)
    except Exception:
        logger.exception("Engine failed to start")
        _report_failure(outputs)
        sys.exit(1)
    # Everything allocated so far lives for the whole process: keep the collector from rescanning it (this pass
    # scans what the model's load made; the imports' objects are frozen already).
    gc.collect()
    gc.freeze()
    try:
        outputs.send(
            EngineReady(
                engine.max_model_len,
                engine.eos_token_ids,
                engine.model_name,
                engine.weight_bytes,
                engine.kv_cache_dtype,
                engine.quantization,
                engine.checkpoint_quantization,
                engine.pooling,
                engine.hf_config.model_type,
                engine.max_images,
            )
        )
        EngineLoop(engine, _PipeInbox(requests, parent_pid), outputs.send).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        logger.info("Front end went away; engine exiting")
    except Exception:
        logger.exception("Engine loop failed")
        _report_failure(outputs)
        sys.exit(1)
    finally:
        engine.close()  # stops the tensor-parallel ranks; kills them when their group failed


class _PipeInbox:
    """The engine loop's inbox over the request pipe; a parent that went away reads as a shutdown."""

    def __init__(self, requests: Connection, parent_pid: int) -> None:
        self.requests = requests
        self.parent_pid = parent_pid
        # Asked once a step: one poll object, where `Connection.poll` builds a selector a call (~5 us a step).
        self._poller = select.poll()
        self._poller.register(requests.fileno(), select.POLLIN)

    def _waiting(self, timeout: float) -> bool:
        """Whether a message (or the pipe's end, which `recv` then raises as EOFError) waits, within `timeout` s."""
        return bool(self._poller.poll(max(0, math.ceil(timeout * 1000))))

    def receive(self, timeout: float, limit: int) -> list[EngineInput]:
        if not self._waiting(timeout):
            return [Shutdown()] if os.getppid() != self.parent_pid else []
        messages = []
        while len(messages) < limit and self._waiting(0):
            messages.append(self.requests.recv())
        return messages


def _report_failure(outputs: Connection, reason: str | None = None) -> None:
    """Tell the front end why the engine is dying: `reason`, or the traceback being handled."""
    with contextlib.suppress(OSError):
        outputs.send(EngineFailed(reason or traceback.format_exc()))
