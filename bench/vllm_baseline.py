"""vLLM as a system of `ferry bench offline`: its offline engine in its own interpreter, over the same workload.

vLLM is not a dependency of Ferry: it runs from the Python of a separate environment (`--vllm-python`, e.g. the
venv `../shared/peers/install-vllm-cpu.sh` makes), fed a JSON job by `bench/vllm_offline.py`. Same model
directory, same token-id prompts and output lengths, greedy with EOS ignored, vLLM's own scheduling defaults
except the slots and token budget every system gets.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from bench.models import BenchModel
from bench.results import SystemRun
from bench.workload import Workload

RUNNER = Path(__file__).with_name("vllm_offline.py")
KV_CACHE_GIB = 2
"""vLLM-CPU's KV cache (`VLLM_CPU_KVCACHE_SPACE`): ample for the benchmark workloads, small next to 24 GiB."""


def vllm_missing(python: Path | None) -> str | None:
    """Why the vllm system cannot run, or None when it can."""
    if python is None:
        return "no --vllm-python given"
    if not os.access(python, os.X_OK):
        return f"--vllm-python {python} is not an executable"
    return None


def run_vllm(
    python: Path,
    model: BenchModel,
    workload: Workload,
    warm: Workload | None,
    *,
    slots: int,
    max_batch_tokens: int,
    repeat: int,
    threads: int | None,
) -> list[SystemRun]:
    """One SystemRun per repeat, after one warm-up pass over `warm` in the same vLLM process."""
    job = {
        "model": str(model.path),
        "dtype": model.dtype_name,
        "load_format": "auto" if model.has_weights else "dummy",
        "max_num_seqs": slots,
        "max_num_batched_tokens": max_batch_tokens,
        "max_model_len": workload.max_seq_len,
        "seed": 0,
        "prompts": workload.prompts,
        "output_lens": workload.output_lens,
        "warmup_prompts": warm.prompts if warm is not None else [],
        "warmup_output_lens": warm.output_lens if warm is not None else [],
        "repeat": repeat,
    }
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB), "HF_HUB_OFFLINE": "1"}
    if threads is not None:
        # vLLM-CPU binds one OpenMP thread per listed core.
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}" if threads > 1 else "0"
    with tempfile.TemporaryDirectory(prefix="ferry-vllm-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        # -P: bench/ must not shadow vLLM's own imports (the runner sits beside this file).
        subprocess.run([str(python), "-P", str(RUNNER), str(job_path), str(out_path)], env=env, check=True)
        result = json.loads(out_path.read_text())
    details = {
        "startup_seconds": result["startup_seconds"],
        "max_num_seqs": slots,
        "max_batch_tokens": max_batch_tokens,
    }
    # vLLM's offline API reports no per-request times: these runs carry no timeline.
    return [
        SystemRun("vllm", wall, tokens, [], dict(details))
        for wall, tokens in zip(result["wall_seconds"], result["tokens"], strict=True)
    ]
