"""CPU threads by step size: a small step runs on `cpu_threads` (0: every core this rank has), a step of
PREFILL_STEP_TOKENS or more on `cpu_prefill_threads` (by default every core this rank has), so that decode steps
leave a core to the front end and prefill steps take them all, and so does a step of a few sequences with a prompt
chunk of SHORT_PREFILL_TOKENS or more (the front end has little to stream then: its first token is what it waits
for). A model of `cpu_wide_model_bytes` or more runs every step on the prefill threads (its steps are long: they
stream the weights)."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from engine.config import EngineConfig

PREFILL_STEP_TOKENS = 256
"""A CPU step of at least this many tokens runs on `cpu_prefill_threads` (measured on the demo model: 256 and 512
gave the same TTFT; below, decode steps with a short new prompt would take the second core from the front end)."""
SHORT_PREFILL_TOKENS = 64
FEW_SEQS = 4
"""A step of at most FEW_SEQS sequences and at least SHORT_PREFILL_TOKENS tokens also runs on the prefill threads:
one 136-token prompt alone on the demo model takes 6.2 ms on two threads against 11.3 on one (in process), so
a lone user's first token comes sooner; at concurrency 8 or more the rule above decides as before."""


class StepThreads(NamedTuple):
    small: int
    """Threads for a decode-sized step."""
    large: int
    """Threads for a prefill-sized step (see the module's docstring)."""

    def use_for(self, num_tokens: int, num_seqs: int) -> None:
        """Set the count for a step of `num_tokens` over `num_seqs` sequences. Per thread in torch: call it on the
        thread that runs the step (the runner's own under async scheduling)."""
        large = num_tokens >= PREFILL_STEP_TOKENS or (num_seqs <= FEW_SEQS and num_tokens >= SHORT_PREFILL_TOKENS)
        torch.set_num_threads(self.large if large else self.small)


def rank_cores(config: EngineConfig) -> int:
    """The cores this process may use, shared among the tensor-parallel ranks of its node."""
    ranks_here = config.parallel.tensor_parallel_size // config.parallel.nnodes
    return max(1, len(os.sched_getaffinity(0)) // ranks_here)


def decode_threads(config: EngineConfig) -> int | None:
    """`cpu_threads` with 0 (every core) resolved to this rank's cores; None leaves torch's setting alone."""
    threads = config.execution.cpu_threads
    return rank_cores(config) if threads == 0 else threads


def step_threads(config: EngineConfig, device: torch.device, weight_bytes: int) -> StepThreads | None:
    """The thread counts of small and large steps on CPU for a model (this rank's shard) of `weight_bytes`; None
    where every step keeps one count (a GPU, cpu_threads None, or no more prefill threads than cpu_threads)."""
    execution = config.execution
    small = decode_threads(config)
    if device.type != "cpu" or small is None:
        return None
    prefill = execution.cpu_prefill_threads
    if prefill is None:
        prefill = rank_cores(config)
    if prefill <= small:
        return None
    wide = 0 < execution.cpu_wide_model_bytes <= weight_bytes
    return StepThreads(prefill if wide else small, prefill)
