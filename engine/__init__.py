"""Ferry's continuous-batching engine."""

from engine.api import ContinuousBatchingManager, generate_batch
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import FinishReason, GenerationOutput, RequestRejected, SamplingParams, StepOutput

__all__ = [
    "ContinuousBatchingManager",
    "EngineConfig",
    "EngineCore",
    "FinishReason",
    "GenerationOutput",
    "RequestRejected",
    "SamplingParams",
    "StepOutput",
    "generate_batch",
]
