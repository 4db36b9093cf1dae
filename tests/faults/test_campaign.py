"""The campaign: clean run, one run per fault, pending faults listed but never run."""

from __future__ import annotations

import json

import pytest

from kvcanary.faults import FAULTS, PENDING_FAULTS, SlidingWindowLut
from kvcanary.faults.campaign import run_campaign

from ._helpers import small_setup


def test_pending_faults_are_listed_and_never_fail_the_campaign():
    result = run_campaign(small_setup(num_requests=8), names=())
    assert result.passed and result.verdicts == [] and result.clean_violations == 0
    (pending,) = result.pending
    assert pending.fault == "sliding_window_lut" and pending.detected is None and not pending.injected
    assert pending.expected == "pending: needs sliding-window pools"
    out = json.loads(json.dumps(result.to_json()))
    assert out["pending"][0]["detected"] is None and out["faults"] == []


def test_pending_faults_are_not_injectable_yet():
    assert set(PENDING_FAULTS).isdisjoint(FAULTS)
    with pytest.raises(ValueError, match="unknown pending"):
        run_campaign(small_setup(num_requests=2), names=(), pending=("nope",))


def test_sliding_window_fault_never_acts(caplog):
    from kvcanary.faults.campaign import run_once

    fault = SlidingWindowLut(warmup_steps=0)
    with caplog.at_level("DEBUG", logger="kvcanary.faults"):
        out = run_once(small_setup(num_requests=4), [fault])
    assert fault.injections == [] and out.violations == []
    assert any("pending: needs sliding-window pools" in r.getMessage() for r in caplog.records)
