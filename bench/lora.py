"""`ferry bench lora`: throughput with LoRA adapters mixed in against the base model alone, in one run.

Adapters of rank `rank` on every attention and MLP projection are made with PEFT on the base model (random values,
small enough to keep the model's output sane, large enough to change it) and kept in `workdir`. Each round runs
the base alone, then 1, 4 and 8 adapters mixed uniformly (request i uses adapter i mod n), in an order that rotates
by round; the figures are medians over rounds, and each configuration's ratio to the base is taken within its own
round, so that this machine's drift does not decide a ratio.

- offline: one in-process engine (`--max-loras` the largest count, `max_num_seqs` the concurrency) generates for
  `num_requests` prompts of random token ids, greedy with a fixed output length;
- serve: one `ferry serve --enable-lora --lora-modules ...`, a closed loop of `concurrency` clients streaming
  completions whose `model` names the adapter (or the base). With `vllm_python`, the same against `vllm serve` with
  the same adapters. A named config's directory gets a tokenizer of token-id words (`x<id>`) first.

Prompts are drawn afresh for every run, so no run finds another's pages in the prefix cache.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from bench.models import prepare_model
from bench.perplexity import DEMO_MODEL
from bench.report import fmt, format_table, stamp
from bench.serve import RequestSample, ServeOptions, _local_server, _send, closed_loop, summarize
from bench.workload import LengthDist, Workload, WorkloadSpec, make_workload

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_STD = 0.02
"""The adapters' random values: on the demo model a rank-16 adapter of this scale changes most greedy outputs
without reducing them to noise."""


@dataclass(frozen=True)
class LoRABenchOptions:
    model: str = str(DEMO_MODEL)
    """A model directory or a named config (bench/models.py: saved random weights, built once in workdir)."""
    workdir: Path = Path("bench-lora")
    adapter_counts: tuple[int, ...] = (1, 4, 8)
    rank: int = 16
    concurrency: int = 32
    num_requests: int = 64
    prompt_tokens: int = 64
    output_tokens: int = 128
    rounds: int = 3
    modes: tuple[str, ...] = ("offline", "serve")
    dtype: str = "auto"
    vllm_python: Path | None = None
    """An environment with vLLM: the serve mode measures `vllm serve` with the same adapters too."""
    timeout: float = 600.0


def build_adapters(base: Path, root: Path, count: int, rank: int) -> list[Path]:
    """`count` PEFT adapters of `base` (rank `rank`, every projection), made once in `root`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = [root / f"adapter-{i}" for i in range(count)]
    missing = [p for p in paths if not (p / "adapter_model.safetensors").is_file()]
    if not missing:
        return paths
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
    peft = get_peft_model(model, config)
    for path in missing:
        torch.manual_seed(paths.index(path))
        with torch.no_grad():
            for name, param in peft.named_parameters():
                if "lora_" in name:
                    param.normal_(0.0, ADAPTER_STD)
        peft.save_pretrained(path)
    return paths


def _workload(options: LoRABenchOptions, vocab_size: int, seed: int) -> Workload:
    spec = WorkloadSpec(
        num_requests=options.num_requests,
        prompt_len=LengthDist("fixed", (float(options.prompt_tokens),)),
        output_len=LengthDist("fixed", (float(options.output_tokens),)),
        seed=seed,
    )
    return make_workload(spec, vocab_size)


def _order(labels: list[str], round_index: int) -> list[str]:
    shift = round_index % len(labels)
    return labels[shift:] + labels[:shift]


def _offline(options: LoRABenchOptions, model_path: Path, adapters: list[Path], vocab: int) -> list[dict[str, Any]]:
    from engine import EngineConfig, EngineCore, SamplingParams, generate_batch
    from engine.core.request import LoRARequest

    config = EngineConfig.of(
        model=str(model_path), dtype=options.dtype, enable_lora=True, max_loras=max(options.adapter_counts),
        max_lora_rank=options.rank, max_num_seqs=options.concurrency,
    )  # fmt: skip
    loras = [LoRARequest(f"adapter-{i}", i + 1, str(path)) for i, path in enumerate(adapters)]
    params = SamplingParams(max_new_tokens=options.output_tokens, temperature=0.0, ignore_eos=True)
    labels = ["base", *(str(n) for n in options.adapter_counts)]
    rates: dict[str, list[float]] = {label: [] for label in labels}
    with EngineCore(config) as engine:
        # Warm-up: every adapter read once, every path compiled or allocated.
        warm = _workload(replace(options, num_requests=len(loras), output_tokens=4), vocab, seed=10_000)
        generate_batch(warm.prompts, params=SamplingParams(max_new_tokens=4, ignore_eos=True), engine=engine,
                       loras=list(loras))  # fmt: skip
        for round_index in range(options.rounds):
            for k, label in enumerate(_order(labels, round_index)):
                workload = _workload(options, vocab, seed=100 * round_index + k)
                count = 0 if label == "base" else int(label)
                per_request = [None if not count else loras[i % count] for i in range(len(workload.prompts))]
                started = time.perf_counter()
                generate_batch(workload.prompts, params=params, engine=engine, loras=per_request)
                rates[label].append(len(workload.prompts) * options.output_tokens / (time.perf_counter() - started))
    return _rows("offline", "ferry", rates)


def _rows(mode: str, system: str, rates: dict[str, list[float]]) -> list[dict[str, Any]]:
    base = rates["base"]
    return [
        {
            "mode": mode,
            "system": system,
            "adapters": label,
            "tokens_per_s": statistics.median(values),
            "vs_base": statistics.median(v / b for v, b in zip(values, base, strict=True)),
            "rounds": values,
        }
        for label, values in rates.items()
    ]


async def _closed_loop(
    url: str, models: list[str], workload: Workload, concurrency: int, timeout: float
) -> tuple[list[RequestSample], float]:
    """The workload's requests through `concurrency` users, request i naming `models[i % len(models)]`."""
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        return await closed_loop(
            len(workload),
            concurrency,
            lambda index, origin: _send(client, url, models[index % len(models)], workload, index, origin),
        )


def _serve(
    options: LoRABenchOptions, model_path: Path, adapters: list[Path], vocab: int, system: str
) -> list[dict[str, Any]]:
    modules = [f"adapter-{i}={path}" for i, path in enumerate(adapters)]
    max_loras = str(max(options.adapter_counts))
    if system == "vllm":
        args = ("--enable-lora", "--max-loras", max_loras, "--max-lora-rank", str(options.rank), "--max-cpu-loras",
                max_loras, "--lora-modules", *modules, "--max-num-seqs", str(options.concurrency), "--dtype",
                options.dtype)  # fmt: skip
        serve = ServeOptions(model=str(model_path), server="vllm", vllm_python=options.vllm_python, server_args=args)
    else:
        args = ("--enable-lora", "--max-loras", max_loras, "--max-lora-rank", str(options.rank), "--lora-modules",
                *modules, "--max-num-seqs", str(options.concurrency), "--dtype", options.dtype)  # fmt: skip
        serve = ServeOptions(model=str(model_path), server_args=args)
    labels = ["base", *(str(n) for n in options.adapter_counts)]
    rates: dict[str, list[float]] = {label: [] for label in labels}
    with _local_server(replace(serve, startup_timeout=600.0)) as url:
        base_name = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        names = [f"adapter-{i}" for i in range(len(adapters))]
        warm = _workload(replace(options, num_requests=len(names), output_tokens=4), vocab, seed=10_000)
        asyncio.run(_closed_loop(url, names, warm, len(names), options.timeout))
        for round_index in range(options.rounds):
            for k, label in enumerate(_order(labels, round_index)):
                workload = _workload(options, vocab, seed=100 * round_index + k + 50)
                models = [base_name] if label == "base" else names[: int(label)]
                samples, duration = asyncio.run(
                    _closed_loop(url, models, workload, options.concurrency, options.timeout)
                )
                summary = summarize(samples, duration)
                if summary["errors"]:
                    first = next(s.error for s in samples if s.error)
                    raise RuntimeError(f"{system} serve, {label} adapters: {summary['errors']} errors: {first}")
                rates[label].append(float(summary["output_throughput"]))  # type: ignore[arg-type]
    return _rows("serve", system, rates)


def run_lora(options: LoRABenchOptions) -> dict[str, Any]:
    options.workdir.mkdir(parents=True, exist_ok=True)
    model = prepare_model(options.model, options.workdir, dtype=options.dtype)
    path, vocab = model.path, model.vocab_size
    adapters = build_adapters(path, options.workdir / f"adapters-{model.name}-r{options.rank}",
                              max(options.adapter_counts), options.rank)  # fmt: skip
    del model  # the transformers copy: the engines load their own
    rows: list[dict[str, Any]] = []
    if "offline" in options.modes:
        rows += _offline(options, path, adapters, vocab)
    if "serve" in options.modes:
        if not (path / "tokenizer.json").is_file():
            _token_id_tokenizer(vocab).save_pretrained(path)
        rows += _serve(options, path, adapters, vocab, "ferry")
        if options.vllm_python is not None:
            rows += _serve(options, path, adapters, vocab, "vllm")
    return {"stamp": stamp(), "options": {k: str(v) for k, v in options.__dict__.items()}, "rows": rows}


def _token_id_tokenizer(vocab_size: int) -> Any:
    """A tokenizer for a named config's random weights, which come without one: the word `x<id>` is token `id`, so
    the servers take the workload's token ids as they are (they check each id against the tokenizer's vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    eos = f"x{vocab_size - 1}"
    tokenizer = Tokenizer(models.WordLevel({f"x{i}": i for i in range(vocab_size)}, unk_token=eos))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, pad_token=eos)


def format_lora(report: dict[str, Any]) -> str:
    header = ["mode", "system", "adapters", "tok/s", "vs base"]
    rows = [
        [r["mode"], r["system"], r["adapters"], fmt(r["tokens_per_s"]), f"{r['vs_base']:.2f}x"] for r in report["rows"]
    ]
    return f"{report['stamp']}\n" + format_table(header, rows)
