"""The campaign: clean run, one run per fault, pending faults listed but never run."""

from __future__ import annotations

import json

import pytest

from kvcanary.faults import FAULTS, PENDING_FAULTS
from kvcanary.runs.campaign import run_campaign

from ._helpers import small_setup


def test_pending_faults_are_listed_and_never_fail_the_campaign():
    result = run_campaign(small_setup(num_requests=8), names=())
    assert result.passed and result.verdicts == [] and result.clean_violations == 0
    assert result.pending == [] and PENDING_FAULTS == {}  # the sliding-window fault runs now (WINDOW_FAULTS)
    out = json.loads(json.dumps(result.to_json()))
    assert out["pending"] == [] and out["faults"] == []


def test_pending_faults_are_not_injectable_yet():
    assert set(PENDING_FAULTS).isdisjoint(FAULTS)
    with pytest.raises(ValueError, match="unknown pending"):
        run_campaign(small_setup(num_requests=2), names=(), pending=("nope",))
