"""More violations than the ring holds: rows past capacity are dropped but counted, totals exact.

The ring fills once and is reset after every row of a full ring was read, so a small ring keeps
the first rows after each reset and drops the rest.
"""

from __future__ import annotations

from collections import Counter

from kvcanary.faults import UsedSlotFlip
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
