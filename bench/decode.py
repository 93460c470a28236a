"""`ferry bench decode`: the time of one decode step at each batch size, against the memory-bandwidth roofline.

A decode step is memory-bound: every weight is read once whatever the batch, and each sequence's K/V once. The real
engine runs a named model with random weights (`load_format="dummy"`); N requests with `context_len`-token prompts
are admitted and prefilled, then pure decode steps are timed (with and without CUDA graphs where `--graphs` asks
for both). The roofline is the bytes one step must read divided by the memory bandwidth:

    weights: every parameter, except an untied input embedding (a step reads N of its rows, not the table), and of a
             mixture of experts' experts the share N tokens route to: each of E experts is routed one of N tokens'
             top-k with probability 1 - (1 - k / E)^N (uniform routing, which random weights give)
    K/V:     N sequences x (mean context over the timed steps) x layers x 2 x KV heads x head_dim x element size

and the fraction reached is roofline time / measured time. The bandwidth is `--bandwidth-gbs` when given, the
H200's ~4,300 GB/s on CUDA, and on CPU a measured copy of a 256 MiB buffer on the benchmark's own thread count
(what those threads can stream, not the socket's peak).
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

import torch
from transformers import AutoConfig

from bench.models import NAMED_CONFIGS
from bench.report import fmt, format_table, stamp
from engine.layers.moe import ClampedSwigluExperts, FusedExperts
from engine.layers.vocab import VocabParallelEmbedding
from engine.models.loader import weight_bytes

if TYPE_CHECKING:
    from engine import EngineCore

H200_BANDWIDTH_GBS = 4300.0
"""What the issue's roofline uses: HBM3e, 4.8 TB/s nominal, ~4.3 TB/s reachable."""
_CPU_PROBE_BYTES = 256 * 2**20


@dataclass
class DecodeOptions:
    model: str = "qwen3-0.6b"
    sizes: tuple[int, ...] = (1, 16, 64, 256)
    context_len: int = 512
    steps: int = 50
    page_size: int = 16
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    graphs: tuple[str, ...] = ("on",)
    """"on": CUDA graphs where the engine uses them (its default); "off": --enforce-eager."""
    quantization: tuple[str, ...] = ("none",)
    """--quantization schemes to measure side by side, each at every batch size (`none`: the model's dtype)."""
    kv_cache_dtype: tuple[str, ...] = ("auto",)
    """--kv-cache-dtype values to measure side by side (`auto`: the model's dtype, `fp8`)."""
    bandwidth_gbs: float | None = None
    seed: int = 0


def _engine(
    model_dir: Path, num_seqs: int, eager: bool, quantization: str, kv_cache_dtype: str, options: DecodeOptions
) -> EngineCore:
    from engine import EngineConfig, EngineCore

    tokens_per_seq = options.context_len + options.steps + 4
    return EngineCore(
        EngineConfig.of(
            model=str(model_dir),
            load_format="dummy",
            device=options.device,
            dtype=options.dtype,
            attention_backend=options.attention_backend,
            page_size=options.page_size,
            num_pages=num_seqs * (ceil(tokens_per_seq / options.page_size) + 1),
            # Every prompt in one prefill step, so every sequence then decodes in lockstep from the same length.
            max_batch_tokens=max(2048, num_seqs * options.context_len),
            max_num_seqs=num_seqs,
            max_model_len=tokens_per_seq + options.page_size,
            max_queue_size=0,
            cpu_threads=None,
            enforce_eager=eager,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
        )
    )


def _synchronize(engine: EngineCore) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _decode_seconds(engine: EngineCore, num_seqs: int, options: DecodeOptions) -> list[float]:
    """Seconds of each of `options.steps` decode steps with `num_seqs` sequences running."""
    from engine import SamplingParams

    rng = random.Random(options.seed)
    vocab = int(engine.hf_config.vocab_size)
    params = SamplingParams(max_new_tokens=options.steps + 4, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(str(i), [rng.randrange(vocab) for _ in range(options.context_len)], params)
    # The prefill step (every prompt, one token each), then two decode steps untimed: first-use allocations.
    prefilled = {output.request_id for output in engine.step() if output.new_token_ids}
    if len(prefilled) != num_seqs:
        raise RuntimeError(f"{len(prefilled)} of {num_seqs} prompts were prefilled in the first step")
    for _ in range(2):
        engine.step()
    seconds = []
    for _ in range(options.steps):
        _synchronize(engine)
        start = time.perf_counter()
        engine.step()
        _synchronize(engine)
        seconds.append(time.perf_counter() - start)
    if engine.stats().num_running != num_seqs:
        raise RuntimeError("sequences finished during the measurement; the running set was not constant")
    return seconds


def step_bytes(engine: EngineCore, num_seqs: int, mean_context: float) -> tuple[int, float]:
    """(weight bytes, K/V bytes) one decode step of `num_seqs` sequences reads (see the module docstring)."""
    model = engine.runner.model
    # An embedding's own table is looked up a row per token, not read whole (a tied table the head reads is the
    # head's read: one the head shares, or reads rows from); buffers (rotary tables) likewise.
    weights = weight_bytes(model)
    embedding = next(m for m in model.modules() if isinstance(m, (torch.nn.Embedding, VocabParallelEmbedding)))
    table = getattr(embedding, "weight", None)
    if table is not None and table is not getattr(getattr(model, "lm_head", None), "weight", None):
        weights -= table.numel() * table.element_size()
    for module in model.modules():
        if isinstance(module, FusedExperts | ClampedSwigluExperts):
            top_k = engine.hf_config.num_experts_per_tok
            unread = (1 - top_k / module.num_experts) ** num_seqs  # an expert's chance that no token routes to it
            weights -= round(unread * weight_bytes(module))
    # What the cache really holds a token in (its dtype: float8 under --kv-cache-dtype fp8), over every layer.
    per_token = sum(layout.page_bytes for layout in engine.kv_cache.layouts) / engine.config.cache.page_size
    return weights, num_seqs * mean_context * per_token


def measure_cpu_bandwidth_gbs() -> float:
    """GB/s one `copy_` streams on this thread count: bytes read plus bytes written, best of five."""
    source = torch.ones(_CPU_PROBE_BYTES // 4)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * _CPU_PROBE_BYTES / best / 1e9


def run_decode(options: DecodeOptions) -> dict[str, object]:
    spec = dict(NAMED_CONFIGS[options.model])
    results = []
    bandwidth = options.bandwidth_gbs
    with tempfile.TemporaryDirectory(prefix="ferry-decode-bench-") as workdir:
        AutoConfig.for_model(spec.pop("model_type"), **spec).save_pretrained(workdir)
        for num_seqs in options.sizes:
            variants = [
                (q, kv, g) for q in options.quantization for kv in options.kv_cache_dtype for g in options.graphs
            ]
            for quantization, kv_cache_dtype, graphs in variants:
                with _engine(Path(workdir), num_seqs, graphs == "off", quantization, kv_cache_dtype, options) as engine:
                    seconds = _decode_seconds(engine, num_seqs, options)
                    device = engine.device
                    # The first timed step reads the prompt and the 3 tokens sampled before it (prefill, 2 untimed).
                    mean_context = options.context_len + 3 + (options.steps - 1) / 2
                    weights, kv = step_bytes(engine, num_seqs, mean_context)
                    uses_graphs = bool(engine.runner.graph_sizes)
                if bandwidth is None:
                    bandwidth = H200_BANDWIDTH_GBS if device.type == "cuda" else measure_cpu_bandwidth_gbs()
                median = statistics.median(seconds)
                roofline = (weights + kv) / (bandwidth * 1e9)
                results.append(
                    {
                        "batch": num_seqs,
                        "quantization": quantization,
                        "kv_cache_dtype": kv_cache_dtype,
                        "graphs": graphs,
                        "cuda_graphs_used": uses_graphs,
                        "ms_per_step_p50": 1e3 * median,
                        "ms_per_step_min": 1e3 * min(seconds),
                        "weight_bytes": weights,
                        "kv_bytes": kv,
                        "roofline_ms": 1e3 * roofline,
                        "roofline_fraction": roofline / median,
                        "tokens_per_s": num_seqs / median,
                    }
                )
    return {
        "benchmark": "decode",
        **stamp(),
        "settings": {
            "model": options.model,
            "context_len": options.context_len,
            "steps": options.steps,
            "page_size": options.page_size,
            "device": options.device,
            "dtype": options.dtype,
            "attention_backend": options.attention_backend,
            "bandwidth_gbs": bandwidth,
            "bandwidth_source": "given"
            if options.bandwidth_gbs is not None
            else ("H200 figure" if bandwidth == H200_BANDWIDTH_GBS else "measured copy"),
        },
        "results": results,
    }


def format_decode(report: dict[str, object]) -> str:
    settings = report["settings"]
    headers = ["batch", "quantization", "KV", "graphs", "ms/step p50", "min", "tok/s", "weights MB", "K/V MB"]
    headers += ["roofline ms", "fraction"]
    rows = [
        [
            str(r["batch"]),
            r.get("quantization", "none"),
            r.get("kv_cache_dtype", "auto"),
            r["graphs"] + ("" if r["cuda_graphs_used"] or r["graphs"] == "off" else " (not used)"),
            fmt(r["ms_per_step_p50"], 3),
            fmt(r["ms_per_step_min"], 3),
            fmt(r["tokens_per_s"], 0),
            fmt(r["weight_bytes"] / 1e6, 1),
            fmt(r["kv_bytes"] / 1e6, 1),
            fmt(r["roofline_ms"], 3),
            fmt(r["roofline_fraction"], 2),
        ]
        for r in report["results"]
    ]
    note = (
        f"{settings['model']} decode steps at context {settings['context_len']}, median of {settings['steps']}; "
        f"roofline: bytes read per step / {settings['bandwidth_gbs']:,.0f} GB/s ({settings['bandwidth_source']})"
    )
    return "\n".join(
        [f"ferry bench decode ({settings['device']}, {settings['dtype']})", format_table(headers, rows), note]
    )
