"""Shared helpers of the fault tests: a small built-in workload with the canary on, and a driver of
it with faults, reports read late and forwards taken for replays."""

from __future__ import annotations

import dataclasses

from kvcanary.config import CanaryConfig
from kvcanary.engine.canary_hooks import CanaryHooks
from kvcanary.engine.config import ModelConfig
from kvcanary.engine.engine import Engine
from kvcanary.engine.workload import WorkloadConfig, builtin_workload, engine_config_for
from kvcanary.errors import CapacityError
from kvcanary.faults.hooks import attach_faults
from kvcanary.runs.driver import run_workload
from kvcanary.runs.setup import RunSetup


def small_setup(num_requests: int = 32, seed: int = 0, engine: dict | None = None, **canary) -> RunSetup:
    """The built-in workload of ``num_requests`` (enough to evict, offload and load back from 24 on)
    with a canary of ``canary`` overrides (sweeps every 4 steps by default)."""
    workload = builtin_workload(WorkloadConfig(num_requests=num_requests, seed=seed))
    config = CanaryConfig(**({"sweep_interval": 4} | canary))
    return RunSetup(ModelConfig(seed=seed), engine_config_for(workload, **(engine or {})), config, workload)


class StepLimit(Exception):
    """A run stopped at its bound on driver ticks."""


@dataclasses.dataclass
class Driven:
    engine: Engine
    hooks: CanaryHooks
    final: list  # the violations of the closing flush (none where the run stopped early)
    complete: bool  # the workload ran to its end


def drive(setup: RunSetup, faults=(), lag: int = 0, replayed: bool = False, max_ticks: int = 3000,
          before_run=None) -> Driven:
    """Drive the workload with the canary and ``faults``; reports read ``lag`` steps late (the
    engine's delivery too); ``replayed``: every forward taken for a graph replay (as on CUDA);
    ``before_run(engine, hooks)``: called once both are built. A bug that acts again on every
    re-prefill may quarantine the pool (CapacityError), break a host invariant (AssertionError)
    or exceed ``max_ticks``: the run then stops, not complete."""
    engine, hooks, _ = attach_faults(lambda h: Engine(setup.model, setup.engine, h), setup.canary, faults)
    if replayed:
        before = hooks.before_forward

        def as_replayed(batch):
            engine.replaying = True  # as the engine sets it before a graph replay
            before(batch)
        hooks.before_forward = as_replayed
    for canary in (hooks.canary, hooks.window_canary):
        if canary is not None:
            canary.reporter.lag = lag
    engine.delivery.lag = lag
    if before_run is not None:
        before_run(engine, hooks)
    ticks = 0

    def bound(done: int, total: int) -> None:
        nonlocal ticks
        ticks += 1
        if ticks > max_ticks:
            raise StepLimit

    try:
        run_workload(engine, setup.workload, bound)
        return Driven(engine, hooks, hooks.flush(engine.step_index).violations, True)
    except (StepLimit, CapacityError, AssertionError):
        return Driven(engine, hooks, [], False)
