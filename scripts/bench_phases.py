"""A decode step's phases in process: an `EngineCore` on a model directory, N sequences each given a prompt and
greedy decode steps, and the medians of the engine's own phase times (schedule, prepare, forward, sample, update:
`StepRecord.phase_seconds`) over the steps where every sequence decoded one token.

    python scripts/bench_phases.py                                   # the demo model, one sequence, one thread
    python scripts/bench_phases.py --sequences 32 --steps 128        # 32 sequences
    PYTHONPATH=/path/to/other/tree python scripts/bench_phases.py    # another checkout, for an A/B

This machine's speed drifts within minutes: compare trees run after one another, several times, and read each
phase against one that neither changes.
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine import EngineConfig, EngineCore, SamplingParams
from engine.core.observer import StepRecord


class _Phases:
    def __init__(self, sequences: int) -> None:
        self.sequences = sequences
        self.rows: list[dict[str, float]] = []

    def on_step(self, record: StepRecord) -> None:
        plan = record.plan
        if len(plan.request_ids) == self.sequences and sum(plan.num_new_tokens) == self.sequences:
            self.rows.append(dict(record.phase_seconds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="server/default_model")
    parser.add_argument("--sequences", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=136)
    parser.add_argument("--steps", type=int, default=256, help="decode steps a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="decode and prefill threads")
    args = parser.parse_args()

    phases = _Phases(args.sequences)
    config = EngineConfig.of(model=args.model, cpu_threads=args.threads, cpu_prefill_threads=args.threads)
    engine = EngineCore(config, observers=[phases])

    def run(steps: int) -> None:
        for i in range(args.sequences):
            prompt = [1 + (i + j) % 100 for j in range(args.prompt_len)]
            params = SamplingParams(max_new_tokens=steps, ignore_eos=True)
            engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params)
        while engine.has_unfinished():
            engine.step()

    run(16)  # warm-up
    for _ in range(args.rounds):
        phases.rows.clear()
        run(args.steps)
        medians = {name: statistics.median(row[name] for row in phases.rows) * 1e6 for name in phases.rows[0]}
        total = sum(medians.values())
        print(
            f"{args.sequences} sequences, {len(phases.rows)} decode steps: phases' sum {total:.0f} us;",
            ", ".join(f"{name} {us:.0f}" for name, us in medians.items()),
        )


if __name__ == "__main__":
    main()
