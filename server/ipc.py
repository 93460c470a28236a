"""The engine process's pipes: what travels over them, and the two messages of the process's own lifecycle.

The engine's protocol (`AddRequests`, `AbortRequests`, `Shutdown` in; a `StepMessage` per step, one answering adds
before the step that runs them, and a `Heartbeat` while idle out) is defined by the engine, in
`engine/core/driver.py`; the server only pickles those messages over two multiprocessing pipes. It adds
`EngineReady` (sent once the model is loaded) and `EngineFailed` (sent just before the process dies of an
exception).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.pooling.config import PoolingConfig


@dataclass(frozen=True, slots=True)
class EngineReady:
    max_model_len: int
    eos_token_ids: frozenset[int]
    model_name: str
    weight_bytes: int
    """The model's weights on one rank (the whole model without tensor parallelism), as stored: quantized codes
    and scales under --quantization."""
    kv_cache_dtype: str
    """What the KV cache stores K and V in (`float8_e4m3fn`, `bfloat16`, ...)."""
    quantization: str
    """The scheme whose kernels run the linear weights: --quantization's, or the quantized checkpoint's."""
    checkpoint_quantization: tuple[str, str] | None
    """(format, its weights in words) of a checkpoint whose quantized weights run as stored; None otherwise."""
    pooling: PoolingConfig | None = None
    """What the model pools (embeddings, classifier or yes/no scores); None for a model that only generates."""
    model_type: str = ""
    """config.json's `model_type` (what `--chat-format auto` reads)."""
    max_images: int = 0
    """Images one prompt may hold (--limit-mm-per-prompt); 0 for a model that takes none, or one served text-only."""


@dataclass(frozen=True, slots=True)
class EngineFailed:
    message: str
