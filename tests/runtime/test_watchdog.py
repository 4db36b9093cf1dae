"""The watchdog fires when checks stop running, and never for launch points that cannot run."""

from __future__ import annotations

import pytest
import torch

from kvcanary.config import Policy
from kvcanary.core.record import STAT_LAUNCHES, LaunchPoint, new_stats
from kvcanary.engine.canary_hooks import attach_canary
from kvcanary.engine.engine import Engine
from kvcanary.runs.driver import run_workload
from kvcanary.runs.single import run_once
from kvcanary.runtime.canary import WatchdogTimeout
from kvcanary.runtime.watchdog import Watchdog

from ._helpers import small_setup

NO_HOST_TIER = {"host_tier_slots": 0}  # no load-back, whose landed-slot checks also launch SWEEP


def launches(stats: torch.Tensor, point: LaunchPoint, n: int = 1) -> None:
    stats[4 * point, STAT_LAUNCHES] += n


def test_unit_fires_once_per_silence_and_rearms():
    dog, stats = Watchdog(window=3), new_stats()
    alarms = []
    for step in range(12):
        launches(stats, LaunchPoint.TAIL)
        if step < 2 or step >= 8:
            launches(stats, LaunchPoint.HEAD)
        alarms += [(step, a.point) for a in dog.observe(stats)]
    assert alarms == [(5, LaunchPoint.HEAD)]  # silent from step 2: 4 > 3 steps at step 5; once; rearmed at 8
    for _ in range(5):
        alarms += [a.point for a in dog.observe(stats)]
    assert alarms[1:] == [LaunchPoint.HEAD, LaunchPoint.TAIL]


def test_unit_never_expects_a_sweep_that_never_ran():
    dog, stats = Watchdog(window=2), new_stats()
    for _ in range(50):
        launches(stats, LaunchPoint.HEAD)
        launches(stats, LaunchPoint.TAIL)
        assert dog.observe(stats) == []


def run_with_bypass(setup, step: int, *names: str):
    """Run ``setup``, replacing the canary's methods ``names`` with no-ops from ``step`` on (as if an
    engine stopped calling them); returns the CanaryHooks."""
    engine, hooks = attach_canary(lambda h: Engine(setup.model, setup.engine, h), setup.canary)

    def progress(done: int, total: int) -> None:
        if engine.step_index == step:
            for name in names:
                setattr(hooks.canary, name, lambda *args, **kwargs: None)

    run_workload(engine, setup.workload, progress)
    return hooks


def alarms_of(hooks):
    return [(r.step, a.point) for r in hooks.reports for a in r.alarms]


def test_fires_when_head_and_tail_are_bypassed():
    setup = small_setup(sweep_interval=4)
    window = setup.canary.watchdog_steps
    hooks = run_with_bypass(setup, 20, "launch_head", "tail")
    alarms = alarms_of(hooks)
    assert sorted(p for _, p in alarms) == [LaunchPoint.HEAD, LaunchPoint.TAIL]
    assert all(s == 20 + window for s, _ in alarms), (alarms, window)
    assert hooks.canary.totals.watchdog_alarms == 2


def test_fires_for_head_alone():
    hooks = run_with_bypass(small_setup(sweep_interval=0, engine=NO_HOST_TIER), 20, "launch_head")
    assert [p for _, p in alarms_of(hooks)] == [LaunchPoint.HEAD]


def test_fires_when_sweeps_stop_after_running():
    setup = small_setup(sweep_interval=2, engine=NO_HOST_TIER)
    hooks = run_with_bypass(setup, 20, "sweep")
    alarms = alarms_of(hooks)
    assert [p for _, p in alarms] == [LaunchPoint.SWEEP]
    assert 20 + setup.canary.watchdog_steps - 2 <= alarms[0][0] <= 20 + setup.canary.watchdog_steps


def test_raises_under_raise_policy():
    setup = small_setup(policy=Policy.RAISE, sweep_interval=0, engine=NO_HOST_TIER)
    with pytest.raises(WatchdogTimeout, match="point=HEAD"):
        run_with_bypass(setup, 10, "launch_head", "tail")


@pytest.mark.parametrize("sweep_interval, engine", [(4, None), (0, NO_HOST_TIER)])
def test_quiet_on_a_clean_run(sweep_interval, engine):
    out = run_once(small_setup(sweep_interval=sweep_interval, engine=engine))
    assert out.alarms == [] and out.hooks.canary.totals.watchdog_alarms == 0
    sweeps = out.hooks.canary.counters()["SWEEP"]["launches"]
    assert (sweeps > 0) == (sweep_interval > 0)


def test_landed_copies_without_periodic_sweeps_never_fire():
    """Load-backs launch SWEEP checks now and then; with sweep_interval 0 nobody promised more."""
    out = run_once(small_setup(sweep_interval=0))
    assert out.engine.stats.num_loaded_slots > 0 and out.hooks.canary.counters()["SWEEP"]["launches"] > 0
    assert out.alarms == [] and out.hooks.canary.totals.watchdog_alarms == 0


def test_unit_sweep_silence_fires_only_with_periodic_sweeps():
    for periodic, want in ((True, [LaunchPoint.SWEEP]), (False, [])):
        dog, stats = Watchdog(window=2, periodic_sweeps=periodic), new_stats()
        launches(stats, LaunchPoint.SWEEP)
        alarms = []
        for _ in range(6):
            launches(stats, LaunchPoint.HEAD)
            launches(stats, LaunchPoint.TAIL)
            alarms += [a.point for a in dog.observe(stats)]
        assert alarms == want, periodic
