"""Every engine option in one dataclass; the CLI, the manager and the benchmarks all build one of these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SchedulerPolicy = Literal["fifo", "prefill_first"]


@dataclass
class EngineConfig:
    model: str
    """A local Hugging Face model directory (config.json, safetensors, tokenizer files)."""
    dtype: str = "auto"
    """`auto` (bfloat16 on GPU, float32 on CPU), `float32`, `bfloat16` or `float16`."""
    device: str = "auto"
    """`auto` (cuda when available), `cpu` or `cuda[:N]`."""
    load_format: Literal["auto", "dummy"] = "auto"
    """`dummy` builds random weights from config.json alone, for benchmarking big models without weights."""
    page_size: int = 16
    """Tokens per KV-cache page."""
    num_blocks: int | None = None
    """Number of KV-cache pages; derived from the memory budget when None."""
    max_memory_percent: float = 0.9
    """GPU: fraction of free device memory (after loading the model) given to the KV cache."""
    cpu_kv_cache_gib: float = 1.0
    """CPU: GiB given to the KV cache."""
    max_batch_tokens: int = 2048
    """Token budget of one step: decode tokens plus prefill chunks."""
    max_num_seqs: int = 256
    """Most sequences in one step."""
    max_model_len: int | None = None
    """Longest prompt + output; defaults to the model's `max_position_embeddings`."""
    scheduler_policy: SchedulerPolicy = "fifo"
    safety_margin: float = 0.0
    """Fraction of all pages kept free for running sequences to grow into: no new prefill is admitted below it."""
    enable_prefix_caching: bool = True
    max_queue_size: int = 1024
    """Most requests waiting for admission; the server answers 429 beyond it. 0 means unbounded."""
    seed: int = 0
    """Seed for requests that sample without a seed of their own."""
    attention_backend: Literal["auto", "torch", "flash"] = "auto"
    model_impl: Literal["auto", "native", "transformers"] = "auto"
    """`auto` uses the native Llama-family modules where they exist and the transformers adapter otherwise."""
    cpu_threads: int | None = 1
    """CPU: torch threads for the engine (None leaves torch's setting alone). One by default: a step is many small
    ops, and OpenMP barriers across threads stall whenever another process competes for the cores (measured on
    2 cores: 756 tok/s with 1 thread, 17 tok/s with 2 while a second process ran)."""
    debug_checks: bool = False
    """Assert page-accounting invariants inside the block manager (tests turn this on)."""

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not 0.0 <= self.safety_margin < 1.0:
            raise ValueError(f"safety_margin must be in [0, 1), got {self.safety_margin}")
        if not 0.0 < self.max_memory_percent <= 1.0:
            raise ValueError(f"max_memory_percent must be in (0, 1], got {self.max_memory_percent}")
        if self.scheduler_policy not in ("fifo", "prefill_first"):
            raise ValueError(f"scheduler_policy must be 'fifo' or 'prefill_first', got {self.scheduler_policy!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
