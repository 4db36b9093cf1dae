"""Policies end to end: clean runs stay silent in every policy and fingerprint mode; raise fails
the readers of the first violation and raises at the end of its step; recompute delivers exactly
the tokens of a fault-free run."""

from __future__ import annotations

import pytest

from kvcanary.config import Policy
from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.engine.engine import Engine
from kvcanary.engine.request import RequestStatus
from kvcanary.errors import CanaryViolation
from kvcanary.faults import FAULTS, PageTableRepoint, attach_faults
from kvcanary.ops.fingerprint import FingerprintMode
from kvcanary.runs.driver import run_workload
from kvcanary.runs.single import run_once
from kvcanary.runtime.reporting import Violation

from ._helpers import small_setup


@pytest.mark.parametrize("policy", [Policy.LOG, Policy.RAISE, Policy.RECOMPUTE], ids=lambda p: p.value)
@pytest.mark.parametrize("real_kv", list(FingerprintMode), ids=lambda m: m.name.lower())
def test_clean_run_reports_nothing(policy, real_kv):
    out = run_once(small_setup(policy=policy, real_kv=real_kv))
    totals = out.hooks.canary.totals
    assert out.error is None and out.violations == [] and out.alarms == []
    assert totals.violations == 0 and totals.recomputed_requests == 0 and out.hooks.reports == []
    stats = out.engine.stats
    assert stats.num_loaded_slots > 0 and stats.num_aborts > 0 and stats.num_recomputes == 0
    assert totals.forwards == stats.num_steps and totals.sweeps > 0


def test_raise_policy_raises_after_the_step_with_the_violations():
    fault = PageTableRepoint(seed=1, warmup_steps=20)
    out = run_once(small_setup(policy=Policy.RAISE), [fault])
    step = fault.injections[0].step
    assert out.error is not None and "KV-cache violation" in out.error
    assert out.engine.step_index == step + 1  # raised at the end of the damaged step, the step done
    assert out.violations and all(isinstance(v, Violation) and v.step == step for v in out.violations)
    first = out.violations[0]
    assert first.point is LaunchPoint.HEAD and Reason.CHAIN in first.reasons
    assert out.hooks.canary.totals.violations == len(out.violations)
    # the readers of the damage failed, named by the error; nobody else did
    readers = {r for v in out.violations for r in v.requests}
    failed = {rid for rid, r in out.engine.requests.items() if r.status is RequestStatus.FAILED}
    assert failed == readers and len(failed) >= 1
    assert f"failed requests: {', '.join(map(str, sorted(failed)))};" in out.error
    out.engine.check_integrity()


def test_raise_policy_exception_carries_the_violations():
    setup = small_setup(policy=Policy.RAISE)
    engine, hooks, _ = attach_faults(lambda h: Engine(setup.model, setup.engine, h), setup.canary,
                                     [PageTableRepoint(seed=1, warmup_steps=20)])
    with pytest.raises(CanaryViolation) as info:
        run_workload(engine, setup.workload)
    assert info.value.violations and info.value.violations[0].line() in str(info.value)


@pytest.fixture(scope="module")
def fault_free_outputs():
    out = run_once(small_setup(policy=Policy.LOG))
    assert out.violations == []
    return [out.engine.output_ids(i) for i in out.counts.request_ids]


@pytest.mark.parametrize("name", list(FAULTS))
def test_recompute_delivers_the_fault_free_tokens(name, fault_free_outputs):
    fault = FAULTS[name](seed=3, warmup_steps=24)
    setup = small_setup(policy=Policy.RECOMPUTE)
    out = run_once(setup, [fault])
    assert fault.injections and out.violations and out.error is None
    engine = out.engine
    # a bad entry names no slot to quarantine: the request is re-prefilled into a fresh page table
    assert engine.stats.num_quarantined_slots > 0 or (name == "page_table_bad_entry" and engine.stats.num_recomputes)
    assert [engine.output_ids(i) for i in out.counts.request_ids] == fault_free_outputs
    for rid, want in zip(out.counts.request_ids, setup.workload.requests, strict=True):
        req = engine.requests[rid]
        assert req.status is (RequestStatus.ABORTED if want.abort_after else RequestStatus.FINISHED)
        assert len(req.output_ids) == (want.abort_after or want.max_new_tokens)
