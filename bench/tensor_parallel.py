"""`ferry bench tp`: what tensor parallelism costs one engine step.

The real engine runs a named model with random weights (`load_format="dummy"`) at TP=1 and at TP=N, every rank
with the engine's one CPU thread; N requests are admitted and prefilled, then pure decode steps are timed. At TP=N
rank 0 also reports the time it spent in each kind of collective (`TensorParallel.seconds`): the plan broadcast
(pickling included), the all-reduces (the embedding's and two per layer) and the logits gather. On CPU those are
gloo over loopback; on CUDA the tensor collectives are asynchronous NCCL calls, so only step times are reported.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from math import ceil
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import AutoConfig

from bench.models import NAMED_CONFIGS
from bench.report import fmt, format_table, stamp

if TYPE_CHECKING:
    from engine import EngineCore

COLLECTIVE_COLUMNS = ("plan", "all_reduce", "gather")


@dataclass
class TensorParallelOptions:
    model: str = "tiny-llama"
    tensor_parallel_size: int = 2
    sizes: tuple[int, ...] = (1, 16, 64)
    steps: int = 100
    prompt_len: int = 16
    page_size: int = 16
    device: str = "cpu"
    dtype: str = "auto"
    seed: int = 0


def _engine(model_dir: Path, tensor_parallel_size: int, num_seqs: int, options: TensorParallelOptions) -> EngineCore:
    from engine import EngineConfig, EngineCore

    tokens_per_seq = options.prompt_len + options.steps + 4
    return EngineCore(
        EngineConfig.of(
            model=str(model_dir),
            load_format="dummy",
            device=options.device,
            dtype=options.dtype,
            page_size=options.page_size,
            num_pages=num_seqs * (ceil(tokens_per_seq / options.page_size) + 1),
            max_batch_tokens=num_seqs * options.prompt_len,
            max_num_seqs=num_seqs,
            max_queue_size=0,
            tensor_parallel_size=tensor_parallel_size,
        )
    )


def _decode_steps(engine: EngineCore, num_seqs: int, options: TensorParallelOptions) -> dict[str, object]:
    """Time `options.steps` decode steps of `num_seqs` running sequences (and rank 0's collectives)."""
    from engine import SamplingParams

    rng = random.Random(options.seed)
    vocab = int(engine.hf_config.vocab_size)
    params = SamplingParams(max_new_tokens=options.steps + 4, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(str(i), [rng.randrange(vocab) for _ in range(options.prompt_len)], params)
    engine.step()  # admit and prefill everyone
    engine.step()  # one decode step untimed: first-use allocations
    if engine.stats().num_running != num_seqs:
        raise RuntimeError(f"only {engine.stats().num_running} of {num_seqs} sequences are running")
    tp = engine.tensor_parallel
    before = dict(tp.seconds) if tp is not None else {}
    step_seconds = []
    for _ in range(options.steps):
        start = time.perf_counter()
        engine.step()
        step_seconds.append(time.perf_counter() - start)
    if engine.stats().num_running != num_seqs:
        raise RuntimeError("sequences finished during the measurement; the running set was not constant")
    result: dict[str, object] = {
        "us_per_step_mean": 1e6 * statistics.fmean(step_seconds),
        "us_per_step_p50": 1e6 * sorted(step_seconds)[len(step_seconds) // 2],
    }
    if tp is not None and tp.device.type == "cpu":
        result["collectives_us_per_step"] = {
            kind: 1e6 * (tp.seconds[kind] - before[kind]) / options.steps for kind in COLLECTIVE_COLUMNS
        }
    return result


def run_tensor_parallel(options: TensorParallelOptions) -> dict[str, object]:
    spec = dict(NAMED_CONFIGS[options.model])
    results = []
    with tempfile.TemporaryDirectory(prefix="ferry-tp-bench-") as workdir:
        AutoConfig.for_model(spec.pop("model_type"), **spec).save_pretrained(workdir)
        for num_seqs in options.sizes:
            row: dict[str, object] = {"running_sequences": num_seqs}
            for size in (1, options.tensor_parallel_size):
                with _engine(Path(workdir), size, num_seqs, options) as engine:
                    row[f"tp{size}"] = _decode_steps(engine, num_seqs, options)
            results.append(row)
    layers = int(NAMED_CONFIGS[options.model]["num_hidden_layers"])
    return {
        "benchmark": "tensor_parallel",
        **stamp(),
        "settings": {
            "model": options.model,
            "tensor_parallel_size": options.tensor_parallel_size,
            "steps": options.steps,
            "prompt_len": options.prompt_len,
            "device": options.device,
            "dtype": options.dtype,
            # The embedding's all-reduce, one after attention and one after the MLP per layer; one gather, one plan.
            "collectives_per_step": {"plan": 1, "all_reduce": 1 + 2 * layers, "gather": 1},
        },
        "results": results,
    }


def format_tensor_parallel(report: dict[str, object]) -> str:
    settings = report["settings"]
    size = settings["tensor_parallel_size"]
    headers = ["running seqs", "TP=1 mean", "p50", f"TP={size} mean", "p50", "plan", "all-reduces", "gather", "sum"]
    rows = []
    for r in report["results"]:
        single, parallel = r["tp1"], r[f"tp{size}"]
        collectives = parallel.get("collectives_us_per_step")
        rows.append(
            [
                str(r["running_sequences"]),
                fmt(single["us_per_step_mean"], 0),
                fmt(single["us_per_step_p50"], 0),
                fmt(parallel["us_per_step_mean"], 0),
                fmt(parallel["us_per_step_p50"], 0),
                *(fmt(collectives[k], 0) if collectives else "" for k in COLLECTIVE_COLUMNS),
                fmt(sum(collectives.values()), 0) if collectives else "",
            ]
        )
    counts = settings["collectives_per_step"]
    note = (
        f"{settings['model']} decode steps, microseconds per step over {settings['steps']}; plan / all-reduces / "
        f"gather: rank 0's mean time per step in each ({counts['plan']} broadcast, {counts['all_reduce']} "
        f"all-reduces, {counts['gather']} gather per step; waits for the other ranks included; CPU only)"
    )
    return "\n".join(
        [f"ferry bench tp: engine step at TP=1 and TP={size} ({settings['device']})", format_table(headers, rows), note]
    )
