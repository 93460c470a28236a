"""Ferry's continuous-batching engine.

Names resolve lazily so that light users (the HTTP front end needs only the request types) do not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ContinuousBatchingManager": "engine.api",
    "generate_batch": "engine.api",
    "EngineConfig": "engine.config",
    "EngineCore": "engine.core.engine_core",
    "EngineStats": "engine.core.stats",
    "FinishReason": "engine.core.request",
    "GenerationOutput": "engine.core.request",
    "QueueFull": "engine.core.request",
    "RequestRejected": "engine.core.request",
    "SamplingParams": "engine.core.request",
    "StepOutput": "engine.core.request",
    "UnsupportedModelError": "engine.models.support",
    "StructuredOutput": "engine.core.request",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
