"""Run `ferry serve` as a real subprocess on 127.0.0.1 for tests (the server and deployment suites share it),
and read what it answers: SSE bodies (checking the framing byte for byte) and Prometheus metrics.

Output goes to a log file (a pipe nobody reads would eventually block the server), shown when the server
fails to come up.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_SECONDS = 300.0
STOP_TIMEOUT_SECONDS = 60.0


class ServerProcess:
    def __init__(self, process: subprocess.Popen[bytes], log_path: Path, port: int) -> None:
        self.process = process
        self.log_path = log_path
        self.base_url = f"http://127.0.0.1:{port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = READY_TIMEOUT_SECONDS) -> None:
        """Wait for /ready to say 200 (the model is loaded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ferry serve exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/ready", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"ferry serve was not ready after {timeout}s:\n{self.log()}")

    def engine_pid(self) -> int:
        """The spawned engine process (the server's child running multiprocessing's spawn_main)."""
        spawned = spawned_children(self.process.pid)
        if not spawned:
            raise LookupError(f"no engine process under pid {self.process.pid}")
        return spawned[0]

    def worker_pids(self) -> list[int]:
        """The tensor-parallel worker ranks the engine process spawned on this node."""
        return spawned_children(self.engine_pid())

    def stop(self, timeout: float = STOP_TIMEOUT_SECONDS) -> int:
        """SIGTERM (a graceful drain), then SIGKILL if it does not exit in time; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _children(pid: int) -> list[int]:
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        children += [int(p) for p in (task / "children").read_text().split()]
    return children


def spawned_children(pid: int) -> list[int]:
    """`pid`'s children started by multiprocessing's spawn (the engine process, tensor-parallel workers)."""
    spawned = []
    for child in _children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"spawn_main" in cmdline:
            spawned.append(child)
    return spawned


def _serve_command(model_dir: Path | None, port: int, extra_args: tuple[str, ...]) -> list[str]:
    model_args = [] if model_dir is None else ["--model", str(model_dir)]
    return [sys.executable, "-m", "ferry", "serve", *model_args, "--host", "127.0.0.1", "--port", str(port),
            *extra_args]  # fmt: skip


def _serve_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment `ferry serve` runs in, with `extra` added. One torch thread: on a shared 2-core machine, two
    spinning OpenMP threads make a tiny model's step ~30x slower than one."""
    return {"OMP_NUM_THREADS": "1", **os.environ, **(extra or {}), "PYTHONUNBUFFERED": "1"}


@contextmanager
def node_process(model_dir: Path, *extra_args: str) -> Iterator[subprocess.Popen[bytes]]:
    """`ferry serve --node-rank K ...` for a node other than 0 of a multi-node run (no HTTP, so no readiness to
    wait for): started, and killed on exit if it is still running; its log is shown when the block fails."""
    with tempfile.TemporaryDirectory(prefix="ferry-node-") as tmp:
        log_path = Path(tmp) / "node.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                _serve_command(model_dir, free_port(), extra_args),
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_serve_env(),
            )
        try:
            yield process
        except BaseException:
            sys.stderr.write(f"--- node log (tail) ---\n{log_path.read_text(errors='replace')[-20_000:]}\n")
            raise
        finally:
            if process.poll() is None:
                process.kill()
            process.wait()


@contextmanager
def server_process(
    model_dir: Path | None, *extra_args: str, env: dict[str, str] | None = None
) -> Iterator[ServerProcess]:
    """A ready `ferry serve --model model_dir ...extra_args` (no --model: the embedded default, or whatever
    `extra_args` name), stopped (SIGTERM) on exit; `env` adds to the environment it runs in."""
    with tempfile.TemporaryDirectory(prefix="ferry-serve-") as tmp:
        log_path = Path(tmp) / "server.log"
        port = free_port()
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                _serve_command(model_dir, port, extra_args),
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_serve_env({"FERRY_STATE_DIR": str(Path(tmp) / "state"), **(env or {})}),
            )
        server = ServerProcess(process, log_path, port)
        try:
            server.wait_ready()
            yield server
        except BaseException:
            sys.stderr.write(f"--- ferry serve log (tail) ---\n{server.log()[-20_000:]}\n")
            raise
        finally:
            server.stop()


@contextmanager
def running_server(model_dir: Path, *extra_args: str) -> Iterator[str]:
    """`with running_server(model_dir, "--max-num-seqs", "4") as base_url:` -> "http://127.0.0.1:PORT"."""
    with server_process(model_dir, *extra_args) as server:
        yield server.base_url


def sse_payloads(body: bytes) -> list[Any]:
    """Parse an OpenAI SSE body, checking the framing byte for byte: `data: <json>\\n\\n` ... `data: [DONE]\\n\\n`.

    Keep-alive comments (`: ping\\n\\n`, sent on a long stream) are the only other frame allowed, and skipped.
    """
    assert body.endswith(b"data: [DONE]\n\n"), body[-200:]
    frames = body[: -len(b"data: [DONE]\n\n")].split(b"\n\n")
    assert frames[-1] == b"", "every event ends with a blank line"
    payloads = []
    for frame in frames[:-1]:
        if frame == b": ping":
            continue
        assert frame.startswith(b"data: ") and b"\n" not in frame, frame
        payloads.append(json.loads(frame[len(b"data: ") :]))
    return payloads


MetricSamples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> MetricSamples:
    """Prometheus text -> {(sample name, sorted labels): value}, through prometheus_client's own parser."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def metric_samples(client: httpx.Client) -> MetricSamples:
    response = client.get("/metrics")
    assert response.status_code == 200
    return parse_metrics(response.text)


def metric(samples: MetricSamples, name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels` (0 when there are none yet)."""
    return sum(value for (n, have), value in samples.items() if n == name and labels.items() <= dict(have).items())


def engine_idle(client: httpx.Client) -> bool:
    """Nothing running or waiting, and every KV-cache page back to free (or merely cached)."""
    samples = metric_samples(client)
    return not any(
        metric(samples, name)
        for name in ("ferry:kv_cache_usage_perc", "ferry:num_requests_running", "ferry:num_requests_waiting")
    )


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)
