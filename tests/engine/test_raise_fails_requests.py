"""The raise policy fails the requests that read damaged K/V, not the engine: the step that found
the damage completes for the others, ``CanaryViolation`` names the failed requests, the damaged
slot is quarantined, and the engine keeps stepping; the clean requests deliver exactly the tokens
of a fault-free run."""

from __future__ import annotations

import pytest

from kvcanary.config import CanaryConfig, Policy
from kvcanary.core.record import Half, LaunchPoint, Reason
from kvcanary.engine.canary_hooks import attach_canary
from kvcanary.engine.request import RequestStatus
from kvcanary.errors import CanaryViolation
from kvcanary.faults.base import flip_bit

from ._helpers import make_engine, random_prompts

PROMPTS = random_prompts(31, 3, min_len=20, max_len=30)
MAX_NEW = 12


def _engine(policy: Policy = Policy.RAISE):
    return attach_canary(lambda h: make_engine(h, enable_prefix_cache=False), CanaryConfig(policy=policy))


def _fault_free() -> dict[int, list[int]]:
    engine, _ = _engine(Policy.LOG)
    ids = [engine.add_request(p, MAX_NEW) for p in PROMPTS]
    engine.run_until_done()
    return {i: engine.output_ids(i) for i in ids}


def test_a_flipped_slot_fails_exactly_its_reader_and_the_engine_goes_on():
    want = _fault_free()
    engine, hooks = _engine()
    ids = [engine.add_request(p, MAX_NEW) for p in PROMPTS]
    while min(len(engine.requests[i].output_ids) for i in ids) < 3:
        engine.step()
    victim = ids[1]
    slot = int(engine.requests[victim].slots[5])
    flip_bit(engine, 0, Half.K, slot, 0, 1)  # inside the fingerprinted first 16 bytes of layer 0 K
    step = engine.step_index
    with pytest.raises(CanaryViolation) as info:
        engine.step()
    e = info.value
    assert e.request_ids == (victim,)
    assert {(v.slot, v.point, v.reasons) for v in e.violations} == {(slot, LaunchPoint.TAIL, Reason.FINGERPRINT)}
    assert f"failed requests: {victim};" in str(e)
    assert engine.step_index == step + 1  # the step completed for the others
    req = engine.requests[victim]
    assert req.status is RequestStatus.FAILED and not req.is_active
    assert engine.pool.num_quarantined_slots == engine.config.page_size
    engine.check_integrity()
    engine.run_until_done()  # usable: no further violation
    engine.check_integrity()
    for rid in ids:
        if rid != victim:
            assert engine.requests[rid].status is RequestStatus.FINISHED
            assert engine.output_ids(rid) == want[rid]
    # the failed request's outputs are those sampled before the damaged step, all of them fault-free
    assert engine.output_ids(victim) == want[victim][: len(engine.output_ids(victim))]
    assert engine.delivery.tokens()[victim] == engine.output_ids(victim)
    assert engine.abort(victim) is False


def test_log_policy_keeps_serving_the_reader():
    engine, hooks = _engine(Policy.LOG)
    ids = [engine.add_request(p, MAX_NEW) for p in PROMPTS]
    while min(len(engine.requests[i].output_ids) for i in ids) < 3:
        engine.step()
    flip_bit(engine, 0, Half.K, int(engine.requests[ids[0]].slots[5]), 0, 1)
    engine.run_until_done()
    assert all(engine.requests[i].status is RequestStatus.FINISHED for i in ids)
    assert sum(len(r.violations) for r in hooks.reports) >= 1
