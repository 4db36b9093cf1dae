"""Byte flip right after TAIL in a slot the forward just wrote."""

from __future__ import annotations

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.faults import Expectation, Fault, WrittenSlotFlip
from kvcanary.faults.judge import judge
from kvcanary.runs.single import run_once

from ._helpers import small_setup


class WrittenSlots(Fault):
    """Records the slots each forward wrote."""

    name = "written_slots"
    expected = Expectation(LaunchPoint.HEAD, Reason.CHAIN)

    def __init__(self):
        super().__init__()
        self.by_step: dict[int, set[int]] = {}

    def after_forward(self, batch, step):
        self.by_step[step] = set(batch.out_cache_loc.tolist())


def test_flip_hits_a_slot_written_in_that_forward_and_its_next_tail_sees_it():
    fault, spy = WrittenSlotFlip(seed=3, warmup_steps=24), WrittenSlots()
    out = run_once(small_setup(), [fault, spy])
    (inj,) = fault.injections
    assert inj.slot in spy.by_step[inj.step] and inj.slot not in spy.by_step[inj.step - 1]
    first = min(out.violations, key=lambda v: v.step)
    assert (first.step, first.point, first.reasons, first.slot) == (inj.step + 1, LaunchPoint.TAIL,
                                                                    Reason.FINGERPRINT, inj.slot)
    assert judge(fault, fault.injections, out.violations).false_positives == 0
