"""Host-tier faults: damage waits on the host and is seen when its row is loaded back."""

from __future__ import annotations

import logging

import pytest

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.faults import Expectation, Fault, HostRowFlip, HostRowMismatch
from kvcanary.faults.judge import judge
from kvcanary.ops.fingerprint import FingerprintMode
from kvcanary.runs.single import run_once

from ._helpers import small_setup

WARMUP = 24


def test_the_workload_loads_back_from_the_host_tier():
    out = run_once(small_setup())
    stats = out.engine.stats
    assert stats.num_offloaded_slots > 0 and stats.num_loaded_slots > 0 and out.violations == []


def test_host_row_flip_is_seen_when_the_row_lands():
    """The load-back's own verification (SWEEP) reports the fingerprint in the load-back step,
    before any forward reads the slot; the forwards that read it later report it at TAIL."""
    fault = HostRowFlip(seed=0, warmup_steps=WARMUP)
    out = run_once(small_setup(), [fault])
    (inj,) = fault.injections
    loaded = fault.load_step[inj]
    first = min(out.violations, key=lambda v: (v.step, v.point is not LaunchPoint.SWEEP))
    assert (first.step, first.point, first.reasons, first.slot) == (loaded, LaunchPoint.SWEEP,
                                                                    Reason.FINGERPRINT, inj.slot)
    assert first.requests == ()  # a landed row: no request owns it yet
    assert {v.point for v in out.violations} == {LaunchPoint.SWEEP, LaunchPoint.TAIL}
    assert all(v.reasons == Reason.FINGERPRINT for v in out.violations)
    assert judge(fault, fault.injections, out.violations).false_positives == 0


def test_host_row_flip_needs_real_kv():
    fault = HostRowFlip(seed=0, warmup_steps=WARMUP)
    out = run_once(small_setup(real_kv=FingerprintMode.NONE), [fault])
    assert fault.load_step and out.violations == []  # the damaged row landed; nothing reads its bytes


def test_host_row_mismatch_is_an_identity_fault():
    """K/V and record of the wrong row travel together: the fingerprint matches, the landed run's
    links and positions do not. Seen by the load-back's verification first, then by the HEAD
    of the request that loaded it (chain, with truth also verify_token), in the same step."""
    fault = HostRowMismatch(seed=1, warmup_steps=WARMUP)
    out = run_once(small_setup(), [fault])
    (inj,) = fault.injections
    loaded = fault.load_step[inj]
    in_step = [v for v in out.violations if v.step == loaded]
    assert in_step[0].point is LaunchPoint.SWEEP and Reason.CHAIN in in_step[0].reasons
    assert any(v.point is LaunchPoint.HEAD and Reason.CHAIN in v.reasons for v in in_step)
    assert min(v.step for v in out.violations) == loaded
    assert all(Reason.FINGERPRINT not in v.reasons for v in out.violations)
    verdict = judge(fault, fault.injections, out.violations)
    assert verdict.detected and verdict.false_positives == 0


class DropHostNodes(Fault):
    """Right after a host fault acted (list it after that fault), drops the host nodes holding its
    waiting rows, once, as a full host tier dropping its LRU leaves would."""

    name = "drop_host_nodes"
    expected = Expectation(LaunchPoint.HEAD, Reason.CHAIN)

    def __init__(self, target: HostRowFlip):
        super().__init__()
        self.target, self.dropped = target, 0

    def after_forward(self, batch, step):
        rows = set().union(*self.target.waiting.values()) if self.target.waiting else set()
        if self.dropped or not rows:
            return
        engine = self.engine
        for node in [n for n in engine.tree.nodes() if n.is_on_host and rows & set(n.host_rows.tolist())]:
            _, freed = engine.tree.remove(node)
            engine.host_tier.free_rows(freed)
            self.dropped += 1


def test_damage_that_leaves_the_host_tier_unread_is_discarded_and_the_fault_acts_again(caplog):
    fault = HostRowFlip(seed=0, warmup_steps=WARMUP)
    dropper = DropHostNodes(fault)
    with caplog.at_level(logging.WARNING, logger="kvcanary.faults"):
        out = run_once(small_setup(), [fault, dropper])
    assert dropper.dropped == 1
    assert any("without a load-back: damage discarded, fault re-armed" in r.getMessage() for r in caplog.records)
    (inj,) = fault.injections
    assert inj.step > WARMUP and fault.load_step[inj] > inj.step
    assert judge(fault, fault.injections, out.violations).detected


@pytest.mark.parametrize("fault_type", [HostRowFlip, HostRowMismatch])
def test_skips_without_a_host_tier(fault_type, caplog):
    fault = fault_type(warmup_steps=0)
    with caplog.at_level(logging.DEBUG, logger="kvcanary.faults"):
        out = run_once(small_setup(num_requests=8, engine={"host_tier_slots": 0}), [fault])
    assert fault.injections == [] and out.violations == []
    assert any("no target waiting request will load" in r.getMessage() for r in caplog.records)
