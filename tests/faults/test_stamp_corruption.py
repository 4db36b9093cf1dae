"""Canary stamp corruption: one bit of a live record, seen by the next HEAD that reads it."""

from __future__ import annotations

import logging

import pytest

from kvcanary.core.hashing import MASK64
from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.engine.engine import Engine
from kvcanary.engine.hooks import EngineHooks
from kvcanary.errors import ConfigError
from kvcanary.faults import FaultHooks, StampCorruption, StampField
from kvcanary.faults.judge import judge
from kvcanary.runs.single import run_once

from ._helpers import small_setup


@pytest.mark.parametrize("field", list(StampField), ids=lambda f: f.value)
def test_damaged_word_is_reported_at_the_next_head(field):
    fault = StampCorruption(field=field.value, seed=2, warmup_steps=24)
    out = run_once(small_setup(), [fault])
    (inj,) = fault.injections
    verdict = judge(fault, fault.injections, out.violations)
    assert verdict.detected and verdict.false_positives == 0
    assert verdict.first_detection == f"{field.value} @ HEAD" and verdict.steps_to_detection == 0
    first = next(v for v in out.violations if v.step == inj.step)
    assert (first.point, first.reasons, first.slot) == (LaunchPoint.HEAD, field.reason, inj.slot)
    assert bin((first.stored_value ^ first.expected_value) & MASK64).count("1") == 1  # one bit flipped
    # the damaged record stays: later reads report it again, never its K/V bytes
    assert all(v.reasons & (Reason.FINGERPRINT | Reason.WRITE_TOKEN | Reason.VERIFY_TOKEN) == 0
               for v in out.violations)


def test_field_is_validated():
    with pytest.raises(ConfigError, match="field"):
        StampCorruption(field="token")
    assert StampCorruption(field=StampField.POSITION).expected.reasons == Reason.POSITION


def test_needs_a_canary(caplog):
    setup = small_setup(num_requests=4)
    fault = StampCorruption()
    hooks = FaultHooks(EngineHooks(), [fault])
    engine = Engine(setup.model, setup.engine, hooks)
    hooks.attach(engine)
    engine.add_request(list(range(1, 9)), 3)
    with caplog.at_level(logging.DEBUG, logger="kvcanary.faults"):
        engine.run_until_done()
    assert fault.injections == [] and any("needs a canary" in r.getMessage() for r in caplog.records)
