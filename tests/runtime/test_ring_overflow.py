"""More violations than the ring holds: rows past capacity are dropped but counted, totals exact.

The ring fills once and is reset after every row of a full ring was read, so a small ring keeps
the first rows after each reset and drops the rest.
"""

from __future__ import annotations

from collections import Counter

from kvcanary.engine.canary_hooks import CanaryHooks
from kvcanary.engine.workload import WorkloadConfig
from kvcanary.engine.zoo import Bug
from kvcanary.faults import UsedSlotFlip
from kvcanary.runs.campaign import run_zoo_case, zoo_cases
from kvcanary.runs.single import run_once

from ._helpers import small_setup


def key(v):
    return v.step, v.point, v.slot, int(v.reasons)


def test_overflowing_ring_counts_every_row():
    runs = {cap: run_once(small_setup(ring_capacity=cap), [UsedSlotFlip(seed=2, warmup_steps=24)])
            for cap in (4096, 3)}
    big, small = runs[4096], runs[3]
    total = len(big.violations)
    assert big.hooks.canary.counters()["dropped"] == 0 and big.hooks.canary.counters()["ring_total"] == total
    assert total > 2 * 3, "the fault must overflow a 3-row ring more than once"
    canary = small.hooks.canary
    counters = canary.counters()
    assert counters["ring_total"] == total
    assert canary.totals.violations == len(small.violations) < total
    assert canary.totals.violations + counters["dropped"] == total
    assert not Counter(map(key, small.violations)) - Counter(map(key, big.violations)), "decoded a row never written"
    assert small.violations[:3] == big.violations[:3]  # the first ring fill is kept whole


def _zoo_run(ring_capacity: int):
    """A real-bug zoo run with thousands of violations (positions restarted on every continued chunk)."""
    setup = small_setup(num_requests=32, ring_capacity=ring_capacity)
    workload = WorkloadConfig(num_requests=32, seed=0, vocab_size=setup.model.vocab_size)
    (case,) = zoo_cases(setup.model, setup.canary, workload, "cpu", [Bug.CHUNK_POSITIONS_RESTART])
    return run_zoo_case(case)


def test_reports_a_step_late_keep_each_row_on_its_own_step_across_ring_restarts(reports_a_step_late, monkeypatch):
    """As on CUDA: the counter restarts behind a full ring while the last snapshot is still unread;
    its rows must be read before the next forward overwrites them (else they come out under the
    wrong step, or as another step's rows). The engine's quarantine is left out of both runs: it
    acts on the rows decoded, which a small ring drops, and the two runs must run alike."""
    monkeypatch.setattr(CanaryHooks, "quarantine", lambda self, violations: None)
    _, big = _zoo_run(1 << 16)
    reports_a_step_late()
    verdict, small = _zoo_run(256)
    assert small.hooks.canary.reporter.lag == 1 and big.hooks.canary.counters()["dropped"] == 0
    counters = small.hooks.canary.counters()
    assert counters["ring_total"] > 4 * 256, "the bug must overflow the ring several times"
    assert not Counter(map(key, small.violations)) - Counter(map(key, big.violations)), "a row under a wrong step"
    assert verdict.detected and verdict.false_positives == 0
