"""The two transformers baselines Ferry is measured against, on the same model object and the same workload.

Static batching: waves of `batch_size` requests, left-padded to a common prompt length, run with `generate` until
the longest output of the wave is done; the next wave starts only then (the barrier). Continuous batching:
transformers' own paged manager (what `generate_batch` wraps), driven request by request because
`generate_batch` takes one `max_new_tokens` for all and the workload gives every request its own.
Both are greedy with EOS disabled (`eos_token_id=[]`), so every request yields exactly its output length.
"""

from __future__ import annotations

import time
from math import ceil

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, StoppingCriteria, StoppingCriteriaList
from transformers.generation.continuous_batching.utils import WorkloadHints

from bench.models import BenchModel
from bench.results import RequestTrace, SystemRun
from bench.workload import Workload

# transformers' default page size for its paged cache; we only choose how many pages it gets.
HF_PAGE_SIZE = 256


class _StepClock(StoppingCriteria):
    """Never stops generation; records when each decoding step finished, to date each request's last token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _greedy_config(model: BenchModel, max_new_tokens: int) -> GenerationConfig:
    return GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=[], pad_token_id=model.pad_token_id
    )


@torch.inference_mode()
def run_static(model: BenchModel, workload: Workload, batch_size: int) -> SystemRun:
    tokens: list[list[int]] = []
    traces: list[RequestTrace] = []
    start = time.perf_counter()
    for first in range(0, len(workload), batch_size):
        prompts = workload.prompts[first : first + batch_size]
        lens = workload.output_lens[first : first + batch_size]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), model.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        clock = _StepClock()
        wave_start = time.perf_counter() - start
        out = model.hf.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=mask.to(model.device),
            generation_config=_greedy_config(model, max(lens)),
            stopping_criteria=StoppingCriteriaList([clock]),
        )
        out = out[:, width:].tolist()
        wave_end = time.perf_counter() - start
        for row, n in enumerate(lens):
            # The wave ran to its longest request; each request keeps only its own length.
            tokens.append(out[row][:n])
            traces.append(RequestTrace(first + row, wave_start, clock.times[n - 1] - start, wave_end, slot=row))
    wall = time.perf_counter() - start
    return SystemRun(
        "static",
        wall,
        tokens,
        traces,
        {"batch_size": batch_size, "waves": ceil(len(workload) / batch_size)},
    )


def hf_continuous_config(
    model: BenchModel, workload: Workload, slots: int, max_batch_tokens: int
) -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(
        page_size=HF_PAGE_SIZE,
        num_blocks=workload.cache_pages(slots, HF_PAGE_SIZE),
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=slots,
        # flash-attn has no float32 kernels: a float32 run keeps the model's own attention.
        auto_switch_to_flash=model.dtype != torch.float32,
    )


@torch.inference_mode()
def run_hf_continuous(
    model: BenchModel, workload: Workload, slots: int, max_batch_tokens: int, *, hf_defaults: bool = False
) -> SystemRun:
    """transformers' continuous batching; `hf_defaults` leaves its ContinuousBatchingConfig at the defaults
    `generate_batch` uses (sized by transformers itself from the workload hints), instead of Ferry's slots."""
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in workload.prompts),
        max_generated_length=max(workload.output_lens),
        num_requests=len(workload),
    )
    cb_config = None if hf_defaults else hf_continuous_config(model, workload, slots, max_batch_tokens)
    manager_cm = model.hf.continuous_batching_context_manager(
        generation_config=_greedy_config(model, max(workload.output_lens)),
        continuous_batching_config=cb_config,
        workload_hints=hints,
        warmup=True,
    )
    results = {}
    # The context manager builds the cache and captures graphs before yielding: that set-up stays untimed.
    with manager_cm as manager:
        attn = model.hf.config._attn_implementation
        start = time.perf_counter()
        for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens, strict=True)):
            manager.add_request(prompt, request_id=str(i), max_new_tokens=n, eos_token_id=[])
        while len(results) < len(workload):
            result = manager.get_result(timeout=1.0)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop died; see its log above")
                continue
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"transformers request {result.request_id} failed: {result.error}")
                results[int(result.request_id)] = result
        wall = time.perf_counter() - start
    traces = [
        # lifespan is (left the queue, finished) on the perf_counter clock.
        RequestTrace(i, r.lifespan[0] - start, r.lifespan[1] - start, r.lifespan[1] - start)
        for i, r in sorted(results.items())
    ]
    tokens = [list(results[i].generated_tokens) for i in range(len(workload))]
    return SystemRun(
        "transformers-cb-default" if hf_defaults else "transformers-cb",
        wall,
        tokens,
        traces,
        {"config": "transformers defaults (as generate_batch)", "attn_implementation": attn}
        if cb_config is None
        else {
            "max_requests_per_batch": slots,
            "page_size": HF_PAGE_SIZE,
            "num_blocks": cb_config.num_blocks,
            "max_batch_tokens": max_batch_tokens,
            "attn_implementation": attn,
        },
    )
