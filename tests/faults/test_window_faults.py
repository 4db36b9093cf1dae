"""Sliding-window table entry repointed, on a hybrid model: the window canary's HEAD sees it."""

from __future__ import annotations

import dataclasses

import pytest

from kvcanary.config import CanaryConfig
from kvcanary.core.record import LaunchPoint, PoolKind, Reason
from kvcanary.engine.config import ModelConfig
from kvcanary.engine.workload import WorkloadConfig, builtin_workload, engine_config_for
from kvcanary.faults import FAULTS, WINDOW_FAULTS, SlidingWindowLut
from kvcanary.faults.judge import judge
from kvcanary.runs.setup import RunSetup
from kvcanary.runs.single import run_once

from ._helpers import small_setup

HYBRID = ModelConfig(num_layers=4, sliding_window=8, window_layers=(0, 2))


def hybrid_setup(num_requests: int = 24, seed: int = 0) -> RunSetup:
    workload = builtin_workload(WorkloadConfig(num_requests=num_requests, seed=seed))
    return RunSetup(dataclasses.replace(HYBRID, seed=seed), engine_config_for(workload),
                    CanaryConfig(sweep_interval=4), workload)


def test_window_fault_is_registered_apart_from_the_full_pool_faults():
    assert set(WINDOW_FAULTS) == {"sliding_window_lut"} and set(WINDOW_FAULTS).isdisjoint(FAULTS)


def test_clean_twin_reports_nothing():
    out = run_once(hybrid_setup())
    assert out.violations == [] and out.error is None
    report = out.hooks.window_report()
    assert report["translated_positions"] > 0 and report["slid_out_positions"] > 0 and report["verified_slots"] > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_repointed_window_entry_is_caught_at_head_of_the_window_pool(seed):
    fault = SlidingWindowLut(seed=seed, warmup_steps=16)
    out = run_once(hybrid_setup(seed=seed), [fault])
    (inj,) = out.injections
    verdict = judge(fault, out.injections, out.violations)
    assert verdict.detected and verdict.false_positives == 0 and verdict.steps_to_detection == 0, verdict
    first = next(v for v in out.violations if inj.explains(v))
    assert first.point is LaunchPoint.HEAD and first.tag.pool is PoolKind.SWA and first.slot == inj.slot
    assert first.reasons & Reason.CHAIN and first.step == inj.step
    assert all(v.tag.pool is PoolKind.SWA for v in out.violations)  # the full pool is untouched


def test_never_acts_without_a_window_pool(caplog):
    fault = SlidingWindowLut(warmup_steps=0)
    with caplog.at_level("DEBUG", logger="kvcanary.faults"):
        out = run_once(small_setup(num_requests=4), [fault])
    assert fault.injections == [] and out.violations == []
    assert any("needs a model with sliding-window layers" in r.getMessage() for r in caplog.records)
