"""Transfer faults of the prefill/decode split: each caught on the decode side with its reason and
launch point, the prefill side silent; the clean twin reports nothing on either side."""

from __future__ import annotations

import pytest

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.faults import FAULTS, PD_FAULTS
from kvcanary.faults.judge import select_faults
from kvcanary.ops.fingerprint import FingerprintMode
from kvcanary.runs.campaign import judge_pd, run_pd_campaign
from kvcanary.runs.pd import run_pd_once

from ._helpers import small_setup

# fault -> (launch point, reasons the first violation must carry)
EXACT = {
    "transfer_byte_flip": (LaunchPoint.SWEEP, Reason.FINGERPRINT),
    "transfer_wrong_slot": (LaunchPoint.SWEEP, Reason.CHAIN | Reason.POSITION),
    "stale_transfer_write": (LaunchPoint.HEAD, Reason.CHAIN),
    "prefill_after_check": (LaunchPoint.SWEEP, Reason.FINGERPRINT),
}


def test_registry():
    assert set(EXACT) == set(PD_FAULTS) and set(PD_FAULTS).isdisjoint(FAULTS)
    with pytest.raises(ValueError, match=r"unknown fault\(s\) \['nope'\]"):
        select_faults(["nope"], 0, 0, pd=True)


def test_clean_twin_reports_nothing_on_either_side():
    out = run_pd_once(small_setup(num_requests=24))
    assert out.prefill.violations == [] and out.decode.violations == [] and out.error is None
    assert out.transfer.stats.requests > 0 and out.injections == []


@pytest.mark.parametrize("name", list(PD_FAULTS))
def test_fault_is_caught_on_the_decode_side(name):
    (fault,) = select_faults([name], seed=1, warmup_steps=6, pd=True)
    out = run_pd_once(small_setup(num_requests=24), [fault])
    verdict = judge_pd(fault, out)
    assert verdict.injected and verdict.detected and verdict.false_positives == 0, verdict
    assert out.prefill.violations == []  # the prefill side stays silent
    (inj,) = out.injections
    order = {LaunchPoint.SWEEP: 0, LaunchPoint.HEAD: 1, LaunchPoint.TAIL: 2}  # within one step
    first = min((v for v in out.decode.violations if inj.explains(v)), key=lambda v: (v.step, order[v.point]))
    point, reasons = EXACT[name]
    assert first.point is point and first.reasons & reasons == reasons and first.step == inj.step, first.line()


def test_fingerprint_faults_need_the_real_kv_check():
    (fault,) = select_faults(["transfer_byte_flip"], seed=1, warmup_steps=6, pd=True)
    out = run_pd_once(small_setup(num_requests=24, real_kv=FingerprintMode.NONE), [fault])
    assert not judge_pd(fault, out).detected


def test_campaign_judges_each_fault():
    result = run_pd_campaign(small_setup(num_requests=16), ["transfer_wrong_slot"], seed=2, warmup_steps=4)
    assert result.passed and result.clean_violations == 0
    assert result.to_json()["faults"][0]["first_detection"].endswith("@ SWEEP")
