#!/usr/bin/env python
"""Structured output's cost over HTTP: `ferry bench serve` unconstrained and with `--response-format json_schema`,
alternated against one `ferry serve`, with the CPU time the engine process spent on each run.

Alternating on one server keeps the two modes under the same conditions (startup, caches, the grammar compiled
once), and the engine's CPU seconds per output token do not depend on how busy the rest of the machine is, which
wall-clock throughput on a shared machine does. Every run asks the same requests (same seed) for the same number
of tokens: bench/schemas/trips.json cannot be complete within the output lengths.

Usage:  python scripts/bench_structured_serve.py --repeats 10 [--model DIR] [--concurrency 32] [--num-requests 64]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
MODES = {
    "text": [],
    "json_schema": ["--response-format", "json_schema", "--schema", str(REPO / "bench/schemas/trips.json")],
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def engine_pid(server_pid: int) -> int:
    """The server's spawned engine process (multiprocessing's spawn_main)."""
    for task in Path(f"/proc/{server_pid}/task").glob("*"):
        for child in (task / "children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    raise LookupError(f"no engine process under pid {server_pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO / "server/default_model"))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=64)
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    serve = [
        sys.executable,
        "-m",
        "ferry",
        "serve",
        "--model",
        args.model,
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    server = subprocess.Popen(serve, cwd=REPO, env=env)
    rows: list[dict[str, float | str]] = []
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"ferry serve exited with {server.returncode}")
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        engine = engine_pid(server.pid)
        bench = [sys.executable, "-m", "ferry", "bench", "serve", "--url", url, "--num-requests",
                 str(args.num_requests), "--concurrency", str(args.concurrency)]  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            for repeat in range(args.repeats):
                for mode, flags in MODES.items():
                    out = Path(tmp) / f"{mode}{repeat}.json"
                    before = cpu_seconds(engine)
                    subprocess.run([*bench, *flags, "--json", str(out)], cwd=REPO, env=env, check=True,
                                   capture_output=True)  # fmt: skip
                    spent = cpu_seconds(engine) - before
                    point = json.loads(out.read_text())["points"][0]
                    row = {"repeat": repeat, "mode": mode, "out_tok_s": point["output_throughput"],
                           "tokens": point["output_tokens"], "engine_cpu_s": spent,
                           "load": os.getloadavg()[0]}  # fmt: skip
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        server.terminate()
        server.wait()
    summary = {}
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        summary[mode] = {
            "median_out_tok_s": statistics.median(float(r["out_tok_s"]) for r in mine),
            "tokens_per_engine_cpu_s": sum(float(r["tokens"]) for r in mine)
            / sum(float(r["engine_cpu_s"]) for r in mine),
        }
    text, constrained = summary["text"], summary["json_schema"]
    print(json.dumps(summary))
    print(
        f"json_schema / unconstrained: {constrained['median_out_tok_s'] / text['median_out_tok_s']:.3f} (median "
        f"out tok/s), {constrained['tokens_per_engine_cpu_s'] / text['tokens_per_engine_cpu_s']:.3f} (tokens per "
        "engine CPU second)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
