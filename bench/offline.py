"""`ferry bench offline`: one workload through static batching, transformers' continuous batching and Ferry.

Same model object (same weights), same prompts, same per-request output lengths, greedy, EOS ignored. The greedy
tokens of the systems are compared before any figure is shown: a speed-up that changes the answers is no speed-up.
Ferry's forward passes are then replayed alone (the model floor) to show how much of its time is the model.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from bench.baselines import run_hf_continuous, run_static
from bench.ferry import build_engine, run_ferry
from bench.floor import Floor, measure_floor
from bench.matmul_floor import MatmulFloor, measure_matmul_floor
from bench.models import BenchModel, WeightsMode, prepare_model
from bench.report import fmt, format_table, stamp
from bench.results import SystemRun
from bench.vllm_baseline import run_vllm, vllm_missing
from bench.workload import LengthDist, Workload, WorkloadSpec, make_workload
from engine.config import CompileLevel

if TYPE_CHECKING:
    from engine import EngineCore

CheckMode = Literal["strict", "report", "off"]
SYSTEMS = ("static", "transformers-cb", "transformers-cb-default", "vllm", "ferry-fallback", "ferry")
DEFAULT_SYSTEMS = ("static", "transformers-cb", "ferry")
_WARMUP_OUTPUT = LengthDist("fixed", (4.0,))


class TokenMismatch(RuntimeError):
    """The systems disagree on greedy tokens; the report lists where."""


@dataclass
class OfflineOptions:
    model: str = "tiny-llama"
    weights: WeightsMode = "saved"
    device: str = "auto"
    dtype: str = "auto"
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    batch_size: int = 32
    """Slots: static wave size, transformers' max_requests_per_batch, Ferry's max_num_seqs."""
    max_batch_tokens: int = 2048
    page_size: int = 16
    attention_backend: str = "auto"
    """Ferry's `attention_backend`."""
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    check: CheckMode = "strict"
    warmup: bool = True
    floor: bool = True
    async_scheduling: bool = False
    """Ferry plans each step while the one before it runs (EngineConfig.async_scheduling)."""
    matmul_floor: bool = False
    """Also time the GEMMs of Ferry's steps alone, at the best speed torch reaches (bench/matmul_floor.py)."""
    plot: Path | None = None
    repeat: int = 1
    """Timed runs per system (and floor replays); the median is reported, every wall time kept in the JSON."""
    profile: Path | None = None
    """After the timed runs, one more Ferry run under the torch profiler; its per-op table is written here."""
    vllm_python: Path | None = None
    """The Python of an environment with vLLM installed, for the `vllm` system (skipped, with a note, without)."""
    threads: int | None = None
    """CPU threads every system runs with (vLLM's are bound to the first cores)."""
    compile: CompileLevel = "none"
    """Ferry's `--compile` level; its start-up (compilation included) is timed and reported."""
    enforce_eager: bool = False
    """Ferry without CUDA graphs (EngineConfig.enforce_eager): what the graphs gain is the difference."""
    quantization: str = "none"
    """Ferry's --quantization (its weights quantized as they load; the other systems run the model's dtype)."""


def _warmup_workload(spec: WorkloadSpec, batch_size: int, vocab_size: int) -> Workload:
    # Other seed, other prefix: warm-up prompts must not seed the prefix caches the timed run then hits.
    warm = dataclasses.replace(
        spec,
        num_requests=min(batch_size, spec.num_requests),
        output_len=_WARMUP_OUTPUT,
        seed=spec.seed + 1_000_003,
    )
    return make_workload(warm, vocab_size)


def compare_tokens(runs: list[SystemRun]) -> list[dict[str, object]]:
    """Every request where a system's tokens differ from the first system's."""
    mismatches = []
    reference = runs[0]
    for other in runs[1:]:
        for i, (want, got) in enumerate(zip(reference.tokens, other.tokens, strict=True)):
            if want != got:
                first = next(
                    (k for k, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got))
                )
                mismatches.append(
                    {
                        "request": i,
                        "systems": [reference.system, other.system],
                        "first_difference": first,
                        "lengths": [len(want), len(got)],
                    }
                )
    return mismatches


def _check(runs: list[SystemRun], model: BenchModel, mode: CheckMode) -> dict[str, object]:
    if mode == "off" or len(runs) < 2:
        return {"mode": "off", "note": "token equality not checked"}
    if not model.has_weights:
        return {"mode": "off", "note": "dummy weights differ between systems: token equality not checked"}
    mismatches = compare_tokens(runs)
    differing = {m["request"] for m in mismatches}
    result: dict[str, object] = {
        "mode": mode,
        "systems": [r.system for r in runs],
        "identical": not mismatches,
        "identical_requests": len(runs[0].tokens) - len(differing),
        "requests": len(runs[0].tokens),
        "mismatches": mismatches,
    }
    if mismatches and mode == "strict":
        lines = [
            f"  request {m['request']}: {m['systems'][0]} vs {m['systems'][1]} differ at token "
            f"{m['first_difference']} (lengths {m['lengths'][0]} / {m['lengths'][1]})"
            for m in mismatches[:20]
        ]
        more = f"\n  ... and {len(mismatches) - 20} more" if len(mismatches) > 20 else ""
        raise TokenMismatch(f"greedy tokens differ in {len(mismatches)} places:\n" + "\n".join(lines) + more)
    return result


def run_offline(options: OfflineOptions) -> dict[str, object]:
    unknown = set(options.systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    with tempfile.TemporaryDirectory(prefix="ferry-bench-") as workdir:
        model = prepare_model(
            options.model,
            Path(workdir),
            device=options.device,
            dtype=options.dtype,
            weights=options.weights,
            # One seed names the whole run: the random weights and the workload.
            seed=options.workload.seed,
        )
        workload = make_workload(options.workload, model.vocab_size)
        warm = _warmup_workload(options.workload, options.batch_size, model.vocab_size)
        slots, budget = options.batch_size, options.max_batch_tokens
        runs: list[SystemRun] = []
        floor: Floor | None = None
        matmul: MatmulFloor | None = None
        repeats = range(options.repeat)
        # Systems run one after the other in a fixed order, each warmed up on other prompts first.
        if "static" in options.systems:
            if options.warmup:
                run_static(model, warm, slots)
            runs.append(_median_run([run_static(model, workload, slots) for _ in repeats], options.check))
        if "transformers-cb" in options.systems:
            if options.warmup:
                run_hf_continuous(model, warm, slots, budget)
            runs.append(
                _median_run([run_hf_continuous(model, workload, slots, budget) for _ in repeats], options.check)
            )
        if "transformers-cb-default" in options.systems:
            if options.warmup:
                run_hf_continuous(model, warm, slots, budget, hf_defaults=True)
            runs.append(
                _median_run(
                    [run_hf_continuous(model, workload, slots, budget, hf_defaults=True) for _ in repeats],
                    options.check,
                )
            )
        skipped: dict[str, str] = {}
        if "vllm" in options.systems:
            missing = vllm_missing(options.vllm_python)
            if missing is not None:
                skipped["vllm"] = missing
            else:
                assert options.vllm_python is not None
                vllm_runs = run_vllm(
                    options.vllm_python,
                    model,
                    workload,
                    warm if options.warmup else None,
                    slots=slots,
                    max_batch_tokens=budget,
                    repeat=options.repeat,
                    threads=options.threads,
                )
                runs.append(_median_run(vllm_runs, options.check))
        if "ferry-fallback" in options.systems:
            # Ferry's engine on transformers' modules (--model-impl transformers): what a family ran on before it
            # had native modules. Closed before the native engine starts, so the two never share the memory.
            with build_engine(
                model, workload, slots=slots, max_batch_tokens=budget, page_size=options.page_size,
                attention_backend=options.attention_backend, model_impl="transformers",
            ) as fallback:  # fmt: skip
                if options.warmup:
                    run_ferry(fallback, warm)
                fallback_runs = [run_ferry(fallback, workload, system="ferry-fallback")[0] for _ in repeats]
            runs.append(_median_run(fallback_runs, options.check))
        if "ferry" in options.systems:
            started = time.perf_counter()
            engine = build_engine(
                model,
                workload,
                slots=slots,
                max_batch_tokens=budget,
                page_size=options.page_size,
                attention_backend=options.attention_backend,
                async_scheduling=options.async_scheduling,
                compile=options.compile,
                enforce_eager=options.enforce_eager,
                quantization=options.quantization,
                cpu_threads=None if options.threads is not None else 0,
            )
            startup_seconds = time.perf_counter() - started
            if options.warmup:
                run_ferry(engine, warm)
            # A repeat hits the prefix cache the one before it filled, so its steps are its own: each records them,
            # and the floors replay the steps of the repeat whose wall time is reported.
            record = options.floor or options.matmul_floor
            recorded = [run_ferry(engine, workload, record_shapes=record) for _ in range(options.repeat)]
            runs.append(_median_run([run for run, _ in recorded], options.check))
            shapes = next(steps for run, steps in recorded if run is runs[-1])
            runs[-1].details["startup_seconds"] = startup_seconds
            if options.profile is not None:
                _profile_ferry(engine, workload, options.profile)
            if options.floor:
                replays = sorted((measure_floor(engine, shapes) for _ in repeats), key=lambda f: f.seconds)
                floor = replays[len(replays) // 2]
            if options.matmul_floor:
                matmul = measure_matmul_floor(engine, shapes)
        check = _check(runs, model, options.check)
        report = _report(options, model, workload, runs, floor, check)
        if matmul is not None:
            report["matmul_floor"] = matmul.summary()
            report["matmul_fraction"] = matmul.seconds / report["systems"]["ferry"]["wall_seconds"]
        report["skipped"] = skipped
        if options.plot is not None:
            from bench.plot import plot_timelines

            plot_timelines(runs, options.plot, _title(model, workload, slots))
            report["plot"] = str(options.plot)
    return report


def _profile_ferry(engine: EngineCore, workload: Workload, path: Path) -> None:
    """Where Ferry's time goes, op by op: an untimed extra run under the torch profiler (CPU self time)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        run_ferry(engine, workload)
    sort = "self_cuda_time_total" if engine.device.type == "cuda" else "self_cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by=sort, row_limit=30) + "\n")


def _median_run(repeats: list[SystemRun], check: CheckMode) -> SystemRun:
    """The repeat of median wall time; under a strict check, a system whose greedy tokens change between repeats
    fails it."""
    first = repeats[0]
    if check == "strict" and any(r.tokens != first.tokens for r in repeats[1:]):
        raise TokenMismatch(f"{first.system} produced different greedy tokens in two repeats of one workload")
    chosen = sorted(repeats, key=lambda r: r.wall_seconds)[len(repeats) // 2]
    chosen.details["repeat_wall_seconds"] = [r.wall_seconds for r in repeats]
    return chosen


def _title(model: BenchModel, workload: Workload, slots: int) -> str:
    spec = workload.spec
    return (
        f"{model.name} ({model.dtype_name}, {model.device.type}): {len(workload)} requests, "
        f"prompt {spec.prompt_len}, output {spec.output_len}, prefix {spec.prefix_len}, {slots} slots"
    )


def _report(
    options: OfflineOptions,
    model: BenchModel,
    workload: Workload,
    runs: list[SystemRun],
    floor: Floor | None,
    check: dict[str, object],
) -> dict[str, object]:
    by_name = {r.system: r for r in runs}
    ratios = {
        r.system: {b: r.tokens_per_second / by_name[b].tokens_per_second for b in by_name if b != r.system}
        for r in runs
    }
    efficiency = floor.seconds / by_name["ferry"].wall_seconds if floor and "ferry" in by_name else None
    return {
        "benchmark": "offline",
        **stamp(),
        "title": _title(model, workload, options.batch_size),
        "model": model.describe(),
        "workload": {
            **workload.spec.describe(),
            "total_prompt_tokens": workload.total_prompt_tokens,
            "total_output_tokens": workload.total_output_tokens,
            "prompt_lens": [len(p) for p in workload.prompts],
            "output_lens": workload.output_lens,
        },
        "settings": {
            "batch_size": options.batch_size,
            "max_batch_tokens": options.max_batch_tokens,
            "page_size": options.page_size,
            "async_scheduling": options.async_scheduling,
            "warmup": options.warmup,
            "repeat": options.repeat,
            "compile": options.compile,
            "enforce_eager": options.enforce_eager,
            "quantization": options.quantization,
        },
        "check": check,
        "profile": str(options.profile) if options.profile else None,
        "systems": {r.system: r.summary() for r in runs},
        "ratios": ratios,
        "floor": floor.summary() if floor else None,
        "efficiency": efficiency,
    }


def format_offline(report: dict[str, object]) -> str:
    systems = report["systems"]
    baselines = [
        b for b in ("static", "transformers-cb", "transformers-cb-default", "vllm", "ferry-fallback") if b in systems
    ]
    headers = ["system", "wall s", "gen tok/s", *(f"vs {b}" for b in baselines), "efficiency"]
    rows = []
    for name, run in systems.items():
        ratios = report["ratios"][name]
        rows.append(
            [
                name,
                fmt(run["wall_seconds"], 3),
                fmt(run["tokens_per_second"], 1),
                *(fmt(ratios.get(b), 2, "x") for b in baselines),
                fmt(report["efficiency"]) if name == "ferry" else "",
            ]
        )
    floor = report["floor"]
    if floor is not None:
        tokens = systems["ferry"]["generated_tokens"]
        rows.append(
            [
                "model floor",
                fmt(floor["seconds"], 3),
                fmt(tokens / floor["seconds"], 1),
                *([""] * len(baselines)),
                "1.00",
            ]
        )
    check = report["check"]
    if check["mode"] == "off":
        verdict = check["note"]
    elif check["identical"]:
        verdict = f"greedy tokens identical across {', '.join(check['systems'])}"
    else:
        verdict = (
            f"greedy tokens identical in {check['identical_requests']} of {check['requests']} requests across "
            f"{', '.join(check['systems'])} ({check['mode']} mode: differences listed in the JSON, not fatal)"
        )
    lines = [report["title"], format_table(headers, rows), verdict]
    lines += [f"{name} skipped: {why}" for name, why in report.get("skipped", {}).items()]
    if "ferry" in systems:
        startup = systems["ferry"]["details"]["startup_seconds"]
        lines.append(f"ferry start-up {startup:.1f} s (engine built, --compile {report['settings']['compile']})")
    if report["settings"]["repeat"] > 1:
        lines.append(f"wall times: median of {report['settings']['repeat']} timed runs per system (all in the JSON)")
    if floor is not None:
        lines.append("efficiency = model floor / Ferry wall time (forward passes of Ferry's own steps, replayed alone)")
    matmul = report.get("matmul_floor")
    if matmul is not None:
        lines.append(
            f"matmul floor {matmul['seconds']:.3f} s ({matmul['gflop']:.1f} GFLOP): Ferry reaches "
            f"{report['matmul_fraction']:.2f} of it (the GEMMs of its steps alone, each shape at the faster of "
            "the model's layer and F.linear)"
        )
    return "\n".join(lines)


def write_json(report: dict[str, object], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
