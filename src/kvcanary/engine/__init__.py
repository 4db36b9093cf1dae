"""The reference paged-KV engine: the embedded default workload of the canary."""

from __future__ import annotations

from kvcanary.engine.config import EngineConfig, ModelConfig, SamplerKind
from kvcanary.engine.engine import Engine, StepResult
from kvcanary.engine.hooks import EngineHooks
from kvcanary.engine.request import Request, RequestStatus
from kvcanary.engine.sampler import SamplingParams
from kvcanary.engine.stats import EngineStats

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineHooks",
    "EngineStats",
    "ModelConfig",
    "Request",
    "RequestStatus",
    "SamplerKind",
    "SamplingParams",
    "StepResult",
]
