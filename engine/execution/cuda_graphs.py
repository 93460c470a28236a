"""Captured decode steps (CUDA graphs): a decode step replays one recorded graph instead of launching every kernel.

A decode step is hundreds of small kernel launches whose host cost exceeds the GPU's work at small batches. At
start-up, once the KV cache exists (a graph bakes in the addresses of the cache, the weights and the runner's
step buffers), the runner's padded decode forward is captured once per size in `graph_sizes`, largest first, all
into one shared memory pool (the graphs never run at once, so a smaller one reuses the blocks the largest freed).
A step is replayed when every scheduled sequence computes one token and there are at most the largest size of
them (`decode_graph_size`); it is padded up to the next size:

    rows [0, n)     the step's sequences, exactly the eager step's inputs
    rows [n, size)  padding: token 0 at position 0, seq_len 1, a page table of the group's scratch page only, its
                    one slot that page's first; so a padded row writes and reads the scratch page, never a real
                    page, and real rows never see it (their page tables list only pages the pool handed out)

The scratch page is one page past each pool's pages (`ModelRunner.scratch_pages`), which the page pool never hands
out. The padding and the static buffers the graphs read are engine/execution/graph_inputs.py's. What is captured is
the model up to the final norm ([size, hidden]); the LM head then runs eagerly on the sampling rows only (logits for
padded rows would be wasted work, and each graph's static output would stay allocated in the pool: [size, vocab]
float32 is large), and sampling stays outside the graph as before.

Graphs run when the device is CUDA, the model is native (the transformers adapter's modules are not checked for
capture), the attention backend is `capturable` (reads only the step's device tensors), tensor_parallel_size is 1
(each layer's all-reduce would be captured: NCCL inside graphs, replayed by every rank in lockstep, is not built
here) and `--enforce-eager` is off; `--compile` is CPU-only, so graphs always capture the eager modules.
Otherwise every step runs eagerly, and the start-up log says why once.

With LoRA adapters (--enable-lora) each size has a second graph, with every adapter slot's product in it
(engine/execution/graph_inputs.py): a decode step with adapters replays that one, a step without them the base
model's.

Steps with a prefill chunk run eagerly: whether prefill steps would gain from graphs of their own token counts is
for a GPU measurement to decide (the offline benchmark in scripts/gpu_bench.sh, graphs on against --enforce-eager,
with the Triton backend, the capturable one on CUDA: torch and flash are not), and is not built. A prefill step's large
matmuls keep the GPU busy, so launch overhead matters far less there than in a decode step.

Memory: engine/execution/memory.py captures the largest size once (both of its graphs, with adapters) before the KV
budget is set, and counts its pool (plus the smaller graphs' outputs) against the budget like the activations.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.config import EngineConfig, EngineStartupError
from engine.models.loader import LoadedModel
from engine.models.state_space import RecurrentCausalLM

logger = logging.getLogger(__name__)

StepFn = Callable[[], torch.Tensor]
"""A decode forward over the runner's static buffers of one size: returns [size, hidden]."""
Capture = Callable[[StepFn], StepFn]
"""Turns the forward of one size into what each step of that size calls (on CUDA: a graph's replay)."""


class GraphedRunner(Protocol):
    """What capture needs of the runner (engine/execution/runner.py, whose PaddedDecode pads its decode steps for
    the graphs)."""

    device: torch.device

    def use_decode_graphs(self, sizes: tuple[int, ...], capture: Capture) -> None: ...


_WARM_UP_RUNS = 2
"""Eager runs of each size before its capture, on a side stream: lazy initialisation (cuBLAS handles and
workspaces, kernel selection) must happen outside the capture, where allocating or synchronising is an error."""


def graph_sizes(max_size: int) -> tuple[int, ...]:
    """Step sizes (sequences) that get a graph: 1, 2, 4, 8, then every 8 up to 64, then every 16, and `max_size`
    itself, never past `max_size`.

    Fine steps where a padded row is a large share of the step, coarser ones above 64 where 15 padded rows are
    under a fifth of it (a decode step reads all the weights whatever its rows, so padding costs little on a GPU):
    23 graphs up to 256 sequences (vLLM's 8-steps would take 35), which bounds capture time and pool memory.
    """
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    grid = [1, 2, 4, *range(8, 64, 8), *range(64, max_size + 1, 16)]
    return (*[s for s in grid if s < max_size], max_size)


def padded_size(sizes: tuple[int, ...], n: int) -> int:
    """The smallest of `sizes` (ascending) that holds `n` rows; `n` must not exceed the largest."""
    if not 0 < n <= sizes[-1]:
        raise ValueError(f"{n} rows do not fit the graph sizes up to {sizes[-1]}")
    return sizes[bisect.bisect_left(sizes, n)]


def decode_graph_size(sizes: tuple[int, ...], num_seqs: int, max_query_len: int) -> int | None:
    """The graph size a step replays, or None when it runs eagerly: only a step whose every sequence computes one
    token (a decode, or the last token of a prompt) and that has at most the largest size of them."""
    if not sizes or max_query_len != 1 or num_seqs > sizes[-1]:
        return None
    return padded_size(sizes, num_seqs)


def max_graph_size(config: EngineConfig) -> int:
    """The largest decode step a graph can hold: a step has at most max_num_seqs sequences and max_batch_tokens
    tokens."""
    return min(config.execution.cuda_graph_max_seqs, config.scheduler.max_num_seqs, config.scheduler.max_batch_tokens)


def eager_reason(config: EngineConfig, loaded: LoadedModel) -> str | None:
    """Why this engine runs every step eagerly, or None when decode steps replay CUDA graphs."""
    if config.execution.enforce_eager:
        return "--enforce-eager"
    if loaded.device.type != "cuda":
        return f"CUDA graphs need a CUDA device, and the engine runs on {loaded.device.type}"
    if config.parallel.tensor_parallel_size > 1:
        return (
            f"--tensor-parallel-size {config.parallel.tensor_parallel_size}: the layers' all-reduces would be "
            "captured, and NCCL inside graphs is not supported here"
        )
    if not loaded.native:
        return "the transformers adapter's modules are not checked for capture (native Llama-family modules only)"
    if isinstance(loaded.model, RecurrentCausalLM):
        return "its state-space layers read each step's state slots and branch on the step's shape, eagerly"
    if not loaded.backend.capturable:
        return f"the {loaded.backend.name} attention backend plans each step on the host, which a graph cannot replay"
    return None


class CudaGraphCapture:
    """The CUDA capture strategy: every size recorded into one shared memory pool, on the runner's device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []
        """Kept alive with the engine: a graph's replay needs the graph and its pool."""

    def __call__(self, forward: StepFn) -> StepFn:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(_WARM_UP_RUNS):
                forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device), torch.cuda.graph(graph, pool=self.pool):
            output = forward()
        self.graphs.append(graph)

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay


@dataclass(frozen=True)
class CaptureReport:
    sizes: tuple[int, ...]
    seconds: float
    pool_bytes: int
    """GPU memory the graphs hold (reserved by the allocator across the capture)."""


def capture_decode_graphs(runner: GraphedRunner, sizes: tuple[int, ...]) -> CaptureReport:
    """Capture the runner's padded decode step at every size (CUDA), measuring time and the memory reserved."""
    device = runner.device
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved(device)
    started = time.perf_counter()
    try:
        runner.use_decode_graphs(sizes, CudaGraphCapture(device))
    except Exception as error:  # capture raises RuntimeError (and torch's subclasses) for anything not capturable
        raise EngineStartupError(
            f"capturing the decode steps in CUDA graphs failed ({type(error).__name__}: {_first_line(error)}); "
            "--enforce-eager runs every step eagerly"
        ) from error
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    # The warm-up runs' blocks are cached outside the graphs' pool: returned, what stays reserved is the pool.
    torch.cuda.empty_cache()
    return CaptureReport(tuple(sizes), seconds, torch.cuda.memory_reserved(device) - reserved)


def start_decode_graphs(runner: GraphedRunner, config: EngineConfig, loaded: LoadedModel) -> CaptureReport | None:
    """At start-up, with the KV cache allocated: capture the decode graphs, or log once why steps run eagerly."""
    reason = eager_reason(config, loaded)
    if reason is not None:
        logger.info("CUDA graphs off, every step runs eagerly: %s", reason)
        return None
    report = capture_decode_graphs(runner, graph_sizes(max_graph_size(config)))
    logger.info(
        "CUDA graphs: %d decode step sizes (%s) captured in %.1f s, %.2f GiB of GPU memory",
        len(report.sizes),
        ", ".join(map(str, report.sizes)),
        report.seconds,
        report.pool_bytes / 2**30,
    )
    return report


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "no message"
