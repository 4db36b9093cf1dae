"""Recovery proof: "with policy recompute and every per-forward fault kind enabled at once, every
request completes and delivers exactly the tokens of the fault-free run"."""

from __future__ import annotations

import pytest

from kvcanary.config import Policy
from kvcanary.engine.config import SamplerKind
from kvcanary.engine.request import RequestStatus
from kvcanary.faults import FAULTS, ChunkBoundaryToken, SampledTokenSwap
from kvcanary.runs.single import run_once

from ._helpers import small_setup

GREEDY = {"sampler": SamplerKind.GREEDY}  # outputs depend on every K/V the model reads


@pytest.fixture(scope="module")
def fault_free():
    out = run_once(small_setup(engine=GREEDY))
    assert out.violations == [] and out.error is None
    return [out.engine.output_ids(i) for i in out.counts.request_ids]


def test_recompute_recovers_from_every_fault_kind_at_once(fault_free):
    """Every injector of ``FAULTS`` at once, token truth on (the default), each acting with
    probability 0.15 per step (the cached-slot flip, which acts only right before a sweep: 0.5),
    at most twice, after 8 warm-up steps. That is every per-forward fault (page-table repoint,
    used- and written-slot flips, sampled-token swap, position skew, chunk-boundary token, stamp
    corruption, host-row flip and mismatch, stale-slot reuse) plus the sweep-only cached-slot
    flip; the sliding-window LUT fault is pending (no sliding-window pools).

    Excluded by nature: token faults without token truth. With ``truth=False`` no forward check
    sees a sampled-token swap or a wrong chunk-boundary token, so the requests keep reading the
    wrong K/V and deliver other tokens (see the next test): nothing can trigger a recompute in time.
    """
    setup = small_setup(policy=Policy.RECOMPUTE, engine=GREEDY)
    faults = [FAULTS[name](probability=0.5 if name == "cached_slot_flip" else 0.15, seed=100 + k, warmup_steps=8,
                           max_injections=2) for k, name in enumerate(FAULTS)]
    out = run_once(setup, faults)
    assert out.error is None
    engine = out.engine
    # the test can fail: every kind damaged something a check then reported, and requests were redone
    reported = {f.name for f in faults if any(i.explains(v) for i in f.injections for v in out.violations)}
    assert reported == set(FAULTS)
    assert all(any(i.explains(v) for f in faults for i in f.injections) for v in out.violations)
    assert engine.stats.num_recomputes > 0 and engine.stats.num_quarantined_slots > 0
    # ...and yet every request completes with exactly the fault-free tokens
    assert [engine.output_ids(i) for i in out.counts.request_ids] == fault_free
    for rid, want in zip(out.counts.request_ids, setup.workload.requests, strict=True):
        req = engine.requests[rid]
        assert req.status is (RequestStatus.ABORTED if want.abort_after else RequestStatus.FINISHED)
        assert len(req.output_ids) == (want.abort_after or want.max_new_tokens)
    engine.check_integrity()


@pytest.mark.parametrize("fault_type", [SampledTokenSwap, ChunkBoundaryToken])
def test_without_token_truth_token_faults_reach_the_client(fault_type, fault_free):
    """Why the recovery proof needs token truth: without it, recompute has nothing to act on in
    time (at most a sweep sees a prefix-cache seam after the request finished), and the damaged
    requests deliver tokens the fault-free run does not."""
    fault = fault_type(seed=0, warmup_steps=24)
    out = run_once(small_setup(policy=Policy.RECOMPUTE, truth=False, engine=GREEDY), [fault])
    assert fault.injections and out.engine.stats.num_recomputes == 0
    got = [out.engine.output_ids(i) for i in out.counts.request_ids]
    assert got != fault_free
