"""Detection under the replayed step's scheduling, for every injector and every zoo bug.

On CUDA a replayed decode step does two things after ``after_forward``, behind the replay the
device still runs: the hooks build the next sweep's runs (``Canary.prefetch_sweep``) on the step
before a sweep, and with reports read a step late the engine delivers the step before's tokens
(``Engine.early_delivery``). Neither may change what the canary finds. Each case runs as two
pairs:
- reports a step late (as on CUDA), every forward taken for a replay, both changes on against
  both off (``CanaryHooks.prefetch_sweeps``, ``Engine.early_delivery``);
- reports read in the step (as on the CPU), the prefetch on with every forward taken for a
  replay, against forwards not taken for replays (no prefetch).
Each pair must find the same violations (step, slot, launch point, reasons), in the same order,
and deliver the same tokens at the same steps. Each run must have found the damage, and the
runs with the prefetch must have used it."""

from __future__ import annotations

import dataclasses

import pytest

from kvcanary.config import CanaryConfig
from kvcanary.engine.config import ModelConfig
from kvcanary.engine.workload import WorkloadConfig
from kvcanary.engine.zoo import Bug
from kvcanary.faults import FAULTS
from kvcanary.faults.judge import judge
from kvcanary.faults.zoo_tracker import ZooTracker
from kvcanary.ops.fingerprint import FingerprintMode
from kvcanary.runs.campaign import zoo_cases

from ._helpers import drive, small_setup


@dataclasses.dataclass
class _Run:
    found: list  # (step, slot, launch point, reasons) of every violation, in report order
    delivered: list  # (step, request, index, token), sorted: a step's requests go out in any order
    prefetches: int
    judged: object


def _run(setup, make_fault, lag: int, replayed: bool, new: bool) -> _Run:
    """One run; ``new``: the hooks' prefetch and the engine's early delivery on (both off else). A
    zoo run may stop early; it stops the same way in both runs of a pair."""
    fault, prefetches = make_fault(), [0]

    def prepared(engine, hooks):
        hooks.prefetch_sweeps = engine.early_delivery = new
        for canary in (hooks.canary, hooks.window_canary):
            if canary is not None:
                prefetch = canary.prefetch_sweep

                def counted(runs, prefetch=prefetch):
                    prefetches[0] += 1
                    return prefetch(runs)
                canary.prefetch_sweep = counted

    run = drive(setup, [fault], lag, replayed, before_run=prepared)
    violations = [v for r in run.hooks.reports for v in r.violations] + run.final
    return _Run([(v.step, v.slot, v.point.name, int(v.reasons)) for v in violations],
                sorted(tuple(d) for d in run.engine.delivery.log), prefetches[0],
                judge(fault, fault.injections, violations))


def _assert_same(got: _Run, want: _Run, prefetched: bool) -> None:
    assert got.judged.injected and got.judged.detected, got.judged
    assert got.found and got.found == want.found
    assert got.delivered == want.delivered and got.delivered
    assert (got.prefetches > 0) is prefetched and want.prefetches == 0


def _fault(name: str):
    return lambda: FAULTS[name](probability=0.5 if name == "cached_slot_flip" else 0.3, seed=3, warmup_steps=8,
                                max_injections=3)


@pytest.mark.parametrize("name", list(FAULTS))
def test_a_fault_is_found_alike_with_the_replayed_steps_scheduling(name):
    setup = small_setup(real_kv=FingerprintMode.PARTIAL)
    make = _fault(name)
    _assert_same(_run(setup, make, 1, True, True), _run(setup, make, 1, True, False), True)
    _assert_same(_run(setup, make, 0, True, True), _run(setup, make, 0, False, True), True)


ZOO_CANARY = CanaryConfig(real_kv=FingerprintMode.PARTIAL, sweep_interval=4)
ZOO_CASES = {c.bug: c for c in zoo_cases(ModelConfig(), ZOO_CANARY, WorkloadConfig(num_requests=32))}


@pytest.mark.parametrize("bug", list(Bug), ids=lambda b: b.value)
def test_a_zoo_bug_is_found_alike_with_the_replayed_steps_scheduling(bug):
    setup = ZOO_CASES[bug].setup
    make = lambda: ZooTracker(bug)  # noqa: E731
    _assert_same(_run(setup, make, 1, True, True), _run(setup, make, 1, True, False), True)
    _assert_same(_run(setup, make, 0, True, True), _run(setup, make, 0, False, True), True)
