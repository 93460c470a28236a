"""Tensor-parallel worker ranks: one process each, spawned by the engine process (node 0) or by `ferry serve` on
the other nodes.

A worker joins the ranks, loads its shard of the model, sizes its KV cache with the others, then runs each plan
the driver broadcasts through its own runner: the same deltas, the same forward pass on its shard, no sampling
(the driver samples from the gathered logits, and every token a worker needs comes in the next plan). It leaves
when the driver says stop, exits non-zero when a collective fails (the driver died or hung), and dies with the
process that spawned it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import sys
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

from engine.config import EngineConfig
from engine.distributed.lifetime import die_with_parent

logger = logging.getLogger(__name__)

STOP_TIMEOUT_SECONDS = 10.0
"""How long stopped workers get to leave on their own before they are killed."""


def run_worker(
    config: EngineConfig, rank: int, parent_pid: int, log_level: str, log_formatter: logging.Formatter | None
) -> None:
    """Entry point of a worker process (rank > 0); it logs at `log_level` through `log_formatter` (its spawner's),
    or in plain text lines naming its rank."""
    die_with_parent(parent_pid)
    # Ctrl-C reaches the whole process group: the process that spawned this one decides what happens. SIGTERM
    # keeps its default (an engine process started by the server ignores it, and spawned children inherit that).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(log_formatter or logging.Formatter(f"%(asctime)s %(levelname)s [rank {rank}] %(message)s"))
    logging.basicConfig(level=log_level, handlers=[handler])
    # Join the ranks as soon as torch is in, so that the driver waits for no more than that import; the model
    # code (transformers and all) loads while the others load theirs.
    from engine.distributed.parallel import CollectiveFailed, init_tensor_parallel

    try:
        tp = init_tensor_parallel(config, rank)
        from engine.execution.startup import start_runner
        from engine.models.loader import load_model

        started = start_runner(config, load_model(config, tp), tp)
        runner = started.runner
        logger.info("rank %d of %d ready on %s: %d KV-cache pages", rank, tp.size, tp.device, started.pages[0])
        while (plan := tp.receive_plan()) is not None:
            runner.execute(plan)
    except CollectiveFailed:
        logger.exception("rank %d lost its peers; exiting", rank)
        _leave(1)
    except Exception:
        logger.exception("rank %d failed", rank)
        _leave(1)
    tp.close()
    _leave(0)


def _leave(status: int) -> None:
    """Exit now, skipping the interpreter's teardown (over a second with torch loaded): nothing is left to flush
    but the log."""
    logging.shutdown()
    os._exit(status)


def _spawner_logging() -> tuple[str, logging.Formatter | None]:
    """This process's log level and its root handler's formatter, for the workers it starts: they log as it does
    (JSON lines under `--log-format json`). No formatter when it has none, or one that cannot travel to a spawned
    process."""
    root = logging.getLogger()
    formatter = next((h.formatter for h in root.handlers if h.formatter is not None), None)
    try:
        pickle.dumps(formatter)
    except (pickle.PicklingError, TypeError, AttributeError):
        formatter = None
    return logging.getLevelName(root.getEffectiveLevel()), formatter


class Workers:
    """Worker processes of this node, as their spawner sees them."""

    def __init__(self, config: EngineConfig, ranks: range) -> None:
        context = multiprocessing.get_context("spawn")
        log_level, log_formatter = _spawner_logging()
        # Daemonic: should the spawner exit without stop(), multiprocessing terminates them on its way out.
        self.processes: list[BaseProcess] = [
            context.Process(
                target=run_worker,
                args=(config, rank, os.getpid(), log_level, log_formatter),
                name=f"ferry-rank-{rank}",
                daemon=True,
            )
            for rank in ranks
        ]
        for process in self.processes:
            process.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid is not None]

    def wait(self) -> int:
        """Block until every worker exited cleanly (0), or one failed: then kill the rest and return 1."""
        remaining = list(self.processes)
        while remaining:
            for sentinel in wait([p.sentinel for p in remaining]):
                process = next(p for p in remaining if p.sentinel == sentinel)
                process.join()
                remaining.remove(process)
                if process.exitcode != 0:
                    logger.error("%s exited with %s", process.name, process.exitcode)
                    self.kill()
                    return 1
        return 0

    def join(self, timeout: float = STOP_TIMEOUT_SECONDS) -> None:
        """Wait up to `timeout` for the workers to leave, then kill whichever has not."""
        for process in self.processes:
            process.join(timeout)
        self.kill()

    def kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join()


def run_node(config: EngineConfig) -> int:
    """`ferry serve` on a node other than 0: run this node's ranks until node 0 stops them (0) or they fail (1)."""
    from engine.distributed.parallel import with_rendezvous

    config.parallel.check_layout()
    config = with_rendezvous(config)
    first = config.parallel.node_rank * config.parallel.ranks_per_node
    logger.info(
        "node %d of %d: ranks %d..%d, meeting at %s:%s",
        config.parallel.node_rank,
        config.parallel.nnodes,
        first,
        first + config.parallel.ranks_per_node - 1,
        config.parallel.master_addr,
        config.parallel.master_port,
    )
    # Kubernetes stops a group's pods together: SIGTERM must not take these ranks away while node 0 drains its
    # requests. They leave when node 0 stops them (or fails); the pod's grace period bounds the wait.
    signal.signal(signal.SIGTERM, lambda *_: logger.info("SIGTERM: the ranks stay up until node 0 stops them"))
    workers = Workers(config, range(first, first + config.parallel.ranks_per_node))
    try:
        return workers.wait()
    except KeyboardInterrupt:
        return 130
    finally:
        workers.kill()
