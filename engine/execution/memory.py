"""How many bytes the KV cache may take: a fixed amount on CPU; on CUDA, what the memory flag leaves once the model
is loaded and the largest step's activations and the decode graphs' memory are set aside.

On CUDA the activations are measured, not guessed: one profiling step runs the biggest batch the scheduler may
plan (`max_batch_tokens` tokens over as many sequences as may run, the longest prompt allowed among them, every
sequence sampled with the costliest sampling options), and its peak allocation above the loaded model is what the
cache must leave free. Load-time garbage (checkpoint staging tensors, the allocator's cached blocks) is returned to
the device first, so that free memory means free.

The decode graphs (engine/execution/cuda_graphs.py), when the engine will capture them, are measured the same way
before the budget is set: the largest size is captured once through a runner with a one-page cache, and what its memory
pool reserved, plus the outputs the smaller graphs keep in the shared pool, is left free too. `gpu_kv_budget_bytes` is
the arithmetic on those measurements.
"""

from __future__ import annotations

import gc
import logging

import torch

from engine.config import EngineConfig, EngineStartupError
from engine.core.kv_cache import GroupLayout
from engine.core.request import PoolingParams, SamplingParams
from engine.core.step import ModelRunnerOutput, NewRequest, SchedulerOutput
from engine.execution.cuda_graphs import capture_decode_graphs, eager_reason, graph_sizes, max_graph_size
from engine.execution.runner import ModelRunner
from engine.models.loader import LoadedModel

logger = logging.getLogger(__name__)

# Every sampling stage at once (penalties, top-k, top-p, min-p, logprobs with the most alternatives): the
# sampler's largest temporaries.
_COSTLIEST_SAMPLING = SamplingParams(
    max_new_tokens=1,
    temperature=1.0,
    top_k=50,
    top_p=0.9,
    min_p=0.05,
    repetition_penalty=1.1,
    logprobs=True,
    top_logprobs=20,
)


def kv_cache_budget_bytes(config: EngineConfig, loaded: LoadedModel, layouts: list[GroupLayout]) -> float:
    """Bytes the KV cache's pools may take: `cpu_kv_cache_gib` on CPU; on CUDA, `max_memory_percent` of the memory
    free after loading, less the activations of the largest step, the decode graphs' memory and the scratch pages
    (refused when that leaves less than one page of every layer)."""
    if loaded.device.type != "cuda":
        return config.cache.cpu_kv_cache_gib * 2**30
    activations = largest_step_activation_bytes(config, loaded, layouts)
    graphs = decode_graph_bytes(config, loaded, layouts) if eager_reason(config, loaded) is None else 0
    free, _ = torch.cuda.mem_get_info(loaded.device)
    # One scratch page per group, each as many layers as the group: one page of every layer in all.
    kv_bytes_per_page = sum(layout.page_bytes for layout in layouts)
    budget = gpu_kv_budget_bytes(free, config.cache.max_memory_percent, activations, graphs, kv_bytes_per_page)
    if budget < kv_bytes_per_page:
        raise EngineStartupError(
            f"no GPU memory is left for the KV cache: {free / 2**30:.2f} GiB free after loading the model, "
            f"--max-memory-percent {config.cache.max_memory_percent} of it, the largest step's activations take "
            f"{activations / 2**30:.2f} GiB and the decode graphs {graphs / 2**30:.2f} GiB; raise "
            "--max-memory-percent, or lower --max-batch-tokens, --max-num-seqs or --cuda-graph-max-seqs "
            "(--enforce-eager captures no graphs)"
        )
    logger.info(
        "GPU memory: %.2f GiB free after loading, %.2f GiB for the largest step's activations, %.2f GiB for the "
        "decode graphs, %.2f GiB for the KV cache (max_memory_percent %.2f)",
        free / 2**30,
        activations / 2**30,
        graphs / 2**30,
        max(budget, 0) / 2**30,
        config.cache.max_memory_percent,
    )
    return budget


def gpu_kv_budget_bytes(
    free: int, max_memory_percent: float, activation_bytes: int, graph_bytes: int, scratch_bytes: int
) -> float:
    """The KV pools' share of the `free` device memory: `max_memory_percent` of it, less what the largest step's
    activations, the decode graphs and the scratch pages (allocated with the cache, outside the pools) take."""
    return free * max_memory_percent - activation_bytes - graph_bytes - scratch_bytes


def decode_graphs_estimate(
    largest_pool_bytes: int, sizes: tuple[int, ...], output_row_bytes: int, graphs_per_size: int = 1
) -> int:
    """The memory all decode graphs hold, from what capturing the largest size alone reserved: the smaller graphs
    reuse the blocks it freed in the shared pool, but each keeps its output ([size, hidden], rounded up to the
    allocator's 512-byte blocks) allocated there; `graphs_per_size`: 2 with LoRA adapters (a base and an adapted
    graph of each size)."""
    outputs = sum(-(-size * output_row_bytes // 512) * 512 for size in sizes[:-1])
    return largest_pool_bytes + graphs_per_size * outputs


def decode_graph_bytes(config: EngineConfig, loaded: LoadedModel, layouts: list[GroupLayout]) -> int:
    """CUDA: the memory the decode graphs will hold, measured by capturing the largest size once through a runner
    with a one-page cache (a graph holds the step's activations, not the cache), then released."""
    sizes = graph_sizes(max_graph_size(config))
    runner = ModelRunner(loaded, layouts, [1] * len(layouts), config)
    largest = capture_decode_graphs(runner, sizes[-1:]).pool_bytes
    del runner  # with it its graph and the graph's pool
    gc.collect()
    torch.cuda.empty_cache()
    row = loaded.hf_config.hidden_size * torch.empty((), dtype=loaded.dtype).element_size()
    return decode_graphs_estimate(largest, sizes, row, graphs_per_size=2 if config.lora.enable_lora else 1)


def largest_step_lengths(max_batch_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths of the largest step: `max_batch_tokens` tokens over as many sequences as may run (the most
    rows to sample), the first ones as long as allowed (the longest attention)."""
    num_seqs = min(max_num_seqs, max_batch_tokens)
    lengths = [1] * num_seqs
    rest = max_batch_tokens - num_seqs
    for i in range(num_seqs):
        extra = min(rest, max_model_len - 1)
        lengths[i] += extra
        rest -= extra
    return lengths


def run_largest_step(config: EngineConfig, loaded: LoadedModel, layouts: list[GroupLayout]) -> ModelRunnerOutput:
    """Run the largest step once through a runner of its own, with just the pages that step fills."""
    lengths = largest_step_lengths(
        config.scheduler.max_batch_tokens, config.scheduler.max_num_seqs, loaded.max_model_len
    )
    pages_of = [-(-length // config.cache.page_size) for length in lengths]
    runner = ModelRunner(loaded, layouts, [sum(pages_of)] * len(layouts), config)
    new_requests = []
    first_page = 0
    for i, (length, pages) in enumerate(zip(lengths, pages_of, strict=True)):
        table = tuple(range(first_page, first_page + pages))
        first_page += pages
        # A model that only pools profiles pooling requests (an encoder's: each input one non-causal span).
        pooling = None if loaded.generates else PoolingParams()
        spans = ((0, length),) if pooling is not None and loaded.pooler and loaded.pooler.config.bidirectional else ()
        new_requests.append(
            NewRequest(
                f"profile-{i}",
                (0,) * length,
                (),
                _COSTLIEST_SAMPLING,
                frozenset(),
                i,
                (table,) * len(layouts),
                noncausal_spans=spans,
                pooling=pooling,
            )
        )
    plan = SchedulerOutput(
        request_ids=tuple(new.request_id for new in new_requests),
        num_computed_tokens=(0,) * len(lengths),
        num_new_tokens=tuple(lengths),
        token_ids=tuple(new.prompt_ids for new in new_requests),
        samples=(loaded.generates,) * len(lengths),
        new_requests=tuple(new_requests),
    )
    return runner.execute(plan)


def largest_step_activation_bytes(config: EngineConfig, loaded: LoadedModel, layouts: list[GroupLayout]) -> int:
    """CUDA: the peak memory the largest step allocates beyond what is already held (its own small KV cache and
    buffers included, which errs on the safe side)."""
    device = loaded.device
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    held = torch.cuda.memory_allocated(device)
    run_largest_step(config, loaded, layouts)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - held
    # The profiling runner is garbage now: give its memory back before free memory is read.
    gc.collect()
    torch.cuda.empty_cache()
    return peak
