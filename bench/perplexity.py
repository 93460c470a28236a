"""`ferry bench perplexity`: what quantization costs a model's predictions, through Ferry's own engine.

Each conversation of a held-out file (by default bench/data/demo_heldout.jsonl: the embedded demo model's own kind
of text, made by scripts/demo_heldout.py) is sent as a prompt with `prompt_logprobs`, and the perplexity is
`exp(mean negative logprob)` of its scored tokens (the assistant's turns). Each `--quantization` scheme runs the
same file on the same engine settings, so the ratios to the first scheme (the model's dtype) are the cost.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from bench.report import fmt, format_table, stamp

DEMO_HELDOUT = Path(__file__).resolve().parent / "data" / "demo_heldout.jsonl"
DEMO_MODEL = Path(__file__).resolve().parents[1] / "server" / "default_model"


@dataclass
class PerplexityOptions:
    model: str = str(DEMO_MODEL)
    text: Path = DEMO_HELDOUT
    quantization: tuple[str, ...] = ("none", "int8", "int4")
    dtype: str = "auto"
    group_size: int = 128


def _conversations(path: Path) -> list[tuple[list[int], list[bool]]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(row["ids"], [bool(s) for s in row["scored"]]) for row in rows]


def _negative_logprobs(options: PerplexityOptions, quantization: str) -> tuple[float, int]:
    """(sum of -logprob over the scored tokens, how many) under one scheme."""
    from engine import EngineConfig, SamplingParams, generate_batch

    conversations = _conversations(options.text)
    config = EngineConfig.of(
        model=options.model,
        dtype=options.dtype,
        quantization=quantization,
        quantization_group_size=options.group_size,
        max_model_len=max(len(ids) for ids, _ in conversations) + 1,
        num_pages=None,
    )
    params = [SamplingParams(max_new_tokens=1, prompt_logprobs=0, ignore_eos=True) for _ in conversations]
    results = generate_batch([ids for ids, _ in conversations], config, params=params)
    total, count = 0.0, 0
    for i, (_, scored) in enumerate(conversations):
        logprobs = results[f"req_{i}"].prompt_logprobs or []  # from the second token on
        for logprob, score in zip(logprobs, scored[1:], strict=True):
            if score:
                total -= logprob.logprob
                count += 1
    return total, count


def run_perplexity(options: PerplexityOptions) -> dict[str, object]:
    results = []
    for quantization in options.quantization:
        total, count = _negative_logprobs(options, quantization)
        results.append({"quantization": quantization, "tokens": count, "perplexity": math.exp(total / count)})
    base = results[0]["perplexity"]
    for row in results:
        row["ratio"] = row["perplexity"] / base
    return {
        "benchmark": "perplexity",
        **stamp(),
        "settings": {
            "model": options.model,
            "text": str(options.text),
            "dtype": options.dtype,
            "group_size": options.group_size,
        },
        "results": results,
    }


def format_perplexity(report: dict[str, object]) -> str:
    settings = report["settings"]
    rows = [
        [r["quantization"], str(r["tokens"]), fmt(r["perplexity"], 4), fmt(r["ratio"], 4)] for r in report["results"]
    ]
    model, text = Path(settings["model"]).name, Path(settings["text"]).name
    title = f"ferry bench perplexity ({model}, {settings['dtype']}, {text})"
    return "\n".join([title, format_table(["quantization", "tokens", "perplexity", "ratio"], rows)])
