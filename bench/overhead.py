"""`ferry bench overhead`: what one engine step costs the CPU when the model costs nothing.

A real EngineCore (scheduler, KV-cache manager, runner, sampler, output deltas) runs on a tiny config-only model
directory: the model is loaded as usual, then handed to the engine inside a stand-in that returns preallocated
zeros. N requests are admitted and prefilled, then pure decode steps are timed: scheduling, batch assembly,
sampling and output processing of N running sequences. The heap is frozen while steps are timed, as the engine
process freezes it after start-up (`bench.ferry.frozen_heap`). On a GPU this cost is what is left of each step when
the device is infinitely fast, so it bounds utilisation for small models.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from math import ceil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig

from bench.ferry import frozen_heap
from bench.report import fmt, format_table, stamp

if TYPE_CHECKING:
    from engine import EngineCore
    from engine.attention.spec import CacheSpec
    from engine.core.observer import StepRecord

# Small vocabulary: greedy argmax over [N, vocab] zeros is real sampler work, but a 32k vocabulary would make it
# the dominant term on a CPU and hide the bookkeeping this benchmark is about.
OVERHEAD_MODEL = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=1024,
    max_position_embeddings=8192,
)
PHASES = ("schedule", "prepare", "forward", "sample", "update")


class ZeroCostModel(torch.nn.Module):
    """Stands in for a loaded model: its shapes, but hidden states and logits are preallocated zeros."""

    def __init__(self, real: torch.nn.Module, max_tokens: int, max_seqs: int, hidden_size: int, vocab_size: int):
        super().__init__()
        device = next(real.parameters()).device
        self.num_layers = real.num_layers
        self._specs = real.cache_specs()
        self._hidden = torch.zeros(max_tokens, hidden_size, device=device)
        self._logits = torch.zeros(max_seqs, vocab_size, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: object) -> torch.Tensor:
        return self._hidden[: input_ids.shape[0]]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._logits[: hidden.shape[0]]

    def cache_specs(self) -> list[CacheSpec]:
        return self._specs


class _PhaseTotals:
    """A step observer adding up each phase's time."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def on_step(self, record: StepRecord) -> None:
        for phase, seconds in record.phase_seconds.items():
            self.seconds[phase] += seconds


@dataclass
class OverheadOptions:
    sizes: tuple[int, ...] = (64, 256, 1024)
    steps: int = 200
    prompt_len: int = 16
    page_size: int = 16
    seed: int = 0


def _generated_tokens(options: OverheadOptions) -> int:
    """Requests outlive the measurement (prefill step, then two timed passes): the running set stays at N."""
    return 2 * options.steps + 4


def _engine(model_dir: Path, num_seqs: int, options: OverheadOptions) -> EngineCore:
    from engine import EngineConfig, EngineCore
    from engine.models.loader import load_model

    tokens_per_seq = options.prompt_len + _generated_tokens(options)
    config = EngineConfig.of(
        model=str(model_dir),
        load_format="dummy",
        device="cpu",
        cpu_threads=None,  # --threads decides
        dtype="float32",
        page_size=options.page_size,
        num_pages=num_seqs * (ceil(tokens_per_seq / options.page_size) + 1),
        # Every prompt is prefilled in one step; decode steps then use num_seqs tokens of it.
        max_batch_tokens=num_seqs * options.prompt_len,
        max_num_seqs=num_seqs,
        max_queue_size=0,
    )
    loaded = load_model(config)
    fake = ZeroCostModel(
        loaded.model,
        config.scheduler.max_batch_tokens,
        num_seqs,
        int(loaded.hf_config.hidden_size),
        int(loaded.hf_config.vocab_size),
    )
    return EngineCore(config, loaded=dataclasses.replace(loaded, model=fake))


def _measure(num_seqs: int, model_dir: Path, options: OverheadOptions) -> dict[str, object]:
    from engine import SamplingParams

    engine = _engine(model_dir, num_seqs, options)
    rng = random.Random(options.seed)
    vocab = int(engine.hf_config.vocab_size)
    params = SamplingParams(max_new_tokens=_generated_tokens(options), ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(str(i), [rng.randrange(vocab) for _ in range(options.prompt_len)], params)
    engine.step()  # admit and prefill everyone
    if engine.stats().num_running != num_seqs:
        raise RuntimeError(f"only {engine.stats().num_running} of {num_seqs} sequences are running")

    step_seconds = []
    with frozen_heap():
        for _ in range(options.steps):
            start = time.perf_counter()
            engine.step()
            step_seconds.append(time.perf_counter() - start)

        # A second pass observed phase by phase: the breakdown, kept apart so the headline has no observer.
        totals = _PhaseTotals()
        engine.observers.append(totals)
        start = time.perf_counter()
        for _ in range(options.steps):
            engine.step()
        observed_total = time.perf_counter() - start
    if engine.stats().num_running != num_seqs:
        raise RuntimeError("sequences finished during the measurement; the running set was not constant")

    breakdown = {name: 1e6 * seconds / options.steps for name, seconds in totals.seconds.items()}
    breakdown["other"] = 1e6 * observed_total / options.steps - sum(breakdown.values())
    ordered = sorted(step_seconds)
    return {
        "running_sequences": num_seqs,
        "steps": options.steps,
        "us_per_step_mean": 1e6 * statistics.fmean(step_seconds),
        "us_per_step_p50": 1e6 * ordered[len(ordered) // 2],
        "us_per_step_p90": 1e6 * ordered[int(0.9 * (len(ordered) - 1))],
        "us_per_sequence": 1e6 * statistics.fmean(step_seconds) / num_seqs,
        "breakdown_us": breakdown,
        "step_seconds": step_seconds,
    }


def run_overhead(options: OverheadOptions) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="ferry-overhead-") as workdir:
        spec = dict(OVERHEAD_MODEL)
        AutoConfig.for_model(spec.pop("model_type"), **spec).save_pretrained(workdir)
        results = [_measure(n, Path(workdir), options) for n in options.sizes]
    return {
        "benchmark": "overhead",
        **stamp(),
        "settings": {
            "prompt_len": options.prompt_len,
            "page_size": options.page_size,
            "steps": options.steps,
            "model": OVERHEAD_MODEL,
        },
        "results": results,
    }


def format_overhead(report: dict[str, object]) -> str:
    headers = ["running seqs", "us/step", "p50", "p90", "us/seq", *PHASES, "other"]
    rows = [
        [
            str(r["running_sequences"]),
            fmt(r["us_per_step_mean"], 0),
            fmt(r["us_per_step_p50"], 0),
            fmt(r["us_per_step_p90"], 0),
            fmt(r["us_per_sequence"], 2),
            *(fmt(r["breakdown_us"][p], 0) for p in (*PHASES, "other")),
        ]
        for r in report["results"]
    ]
    note = (
        "engine step with a zero-cost model (decode only, CPU); phase columns from a second, observed pass;"
        " forward = runner.forward around the fake model; update = token appends, stop rules, page commits, output"
        " deltas; other = the step's own bookkeeping and the observer"
    )
    return "\n".join(["ferry bench overhead: CPU microseconds per engine step", format_table(headers, rows), note])
