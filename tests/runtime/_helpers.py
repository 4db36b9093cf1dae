"""Shared helpers of the runtime tests: a small built-in workload with the canary on."""

from __future__ import annotations

from kvcanary.config import CanaryConfig
from kvcanary.engine.config import ModelConfig
from kvcanary.engine.workload import WorkloadConfig, builtin_workload, engine_config_for
from kvcanary.runs.setup import RunSetup


def small_setup(num_requests: int = 32, seed: int = 0, engine: dict | None = None, **canary) -> RunSetup:
    """The built-in workload of ``num_requests`` (enough to evict, offload and load back from 24 on)
    with a canary of ``canary`` overrides (sweeps every 4 steps by default)."""
    workload = builtin_workload(WorkloadConfig(num_requests=num_requests, seed=seed))
    config = CanaryConfig(**({"sweep_interval": 4} | canary))
    return RunSetup(ModelConfig(seed=seed), engine_config_for(workload, **(engine or {})), config, workload)
