"""Faults on what a forward writes (tokens, positions): what each check sees, and what it takes.

The sampled-token swap and the chunk-boundary token are only visible to token checks, so they
depend on token truth; the tests below pin both what is seen with truth and what is (not) seen
without it.
"""

from __future__ import annotations

import re

import pytest

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.errors import ConfigError
from kvcanary.faults import ChunkBoundaryToken, Expectation, Fault, PositionSkew, SampledTokenSwap
from kvcanary.faults.judge import judge
from kvcanary.runs.single import run_once

from ._helpers import small_setup

WARMUP = 24
TOKEN_CHECKS = Reason.WRITE_TOKEN | Reason.VERIFY_TOKEN


class Extends(Fault):
    """Records each forward's extends: step -> {request id: (prefix_len, extend_len)}."""

    name = "extends"
    expected = Expectation(LaunchPoint.HEAD, Reason.CHAIN)

    def __init__(self):
        super().__init__()
        self.by_step: dict[int, dict[int, tuple[int, int]]] = {}

    def before_forward(self, batch, step):
        self.by_step[step] = {rid: (prefix, extend) for _, rid, prefix, extend in self.batch_requests(batch)}


@pytest.fixture(scope="module")
def clean_without_truth():
    return run_once(small_setup(truth=False))


def test_token_swap_is_seen_by_token_checks_only():
    """Both written slots report write_token at HEAD, each holding the other's token; later reads
    report verify_token. The chain was stamped from the tokens actually written and the
    fingerprint from the K/V actually written, so no identity check ever fails."""
    fault = SampledTokenSwap(seed=0, warmup_steps=WARMUP)
    out = run_once(small_setup(), [fault])
    (inj,) = fault.injections
    assert judge(fault, fault.injections, out.violations).false_positives == 0
    at_head = [v for v in out.violations if v.step == inj.step]
    assert [(v.point, v.reasons) for v in at_head] == [(LaunchPoint.HEAD, Reason.WRITE_TOKEN)] * 2
    a, b = at_head
    assert inj.slot in {a.slot, b.slot} and a.token == b.expected_token and b.token == a.expected_token
    later = [v for v in out.violations if v.step > inj.step]
    assert later and all(v.reasons == Reason.VERIFY_TOKEN for v in later)
    assert {v.slot for v in later} == {a.slot, b.slot}


def test_token_swap_goes_unseen_without_token_truth(clean_without_truth):
    """Without truth no forward check compares tokens, and here the swapped slots move to the host
    tier before any sweep reaches them: nothing at all is reported (nor in the clean twin)."""
    fault = SampledTokenSwap(seed=0, warmup_steps=WARMUP)
    out = run_once(small_setup(truth=False), [fault])
    assert fault.injections and out.violations == []
    assert clean_without_truth.violations == []


def test_without_truth_only_a_sweep_of_the_idle_cached_slot_sees_the_swap():
    """A sweep compares idle prefix-cache slots with the prefix cache's keys (the engine's token
    history), whatever ``truth`` says. With a pool large enough that the finished requests' slots
    stay on the device, a sweep reports verify_token there, after the requests finished."""
    fault = SampledTokenSwap(seed=0, warmup_steps=WARMUP)
    out = run_once(small_setup(truth=False, engine={"num_slots": 4096}), [fault])
    (inj,) = fault.injections
    verdict = judge(fault, fault.injections, out.violations)
    assert out.violations and verdict.false_positives == 0 and not verdict.detected  # not at HEAD
    assert all(v.point is LaunchPoint.SWEEP and v.reasons == Reason.VERIFY_TOKEN and v.requests == ()
               for v in out.violations)
    assert min(v.step for v in out.violations) > inj.step


def test_chunk_boundary_token_replaces_the_first_token_of_a_later_chunk():
    fault, spy = ChunkBoundaryToken(seed=0, warmup_steps=WARMUP), Extends()
    out = run_once(small_setup(), [fault, spy])
    (inj,) = fault.injections
    rid, position = map(int, re.search(r"request=(\d+) position=(\d+)", inj.detail).groups())
    # the chunk starts there, and the request's previous chunk, computed in an earlier forward, ended there
    assert spy.by_step[inj.step][rid][0] == position
    earlier = [e[rid] for s, e in sorted(spy.by_step.items()) if s < inj.step and rid in e]
    assert earlier and sum(earlier[-1]) == position
    req = out.engine.requests[rid]
    first = min(out.violations, key=lambda v: v.step)
    assert (first.step, first.point, first.reasons, first.slot) == (inj.step, LaunchPoint.HEAD,
                                                                    Reason.WRITE_TOKEN, inj.slot)
    assert first.position == position and first.expected_token == req.prompt_ids[position] != first.token
    assert judge(fault, fault.injections, out.violations).false_positives == 0


def test_chunk_boundary_token_without_truth_shows_only_at_a_prefix_cache_seam(clean_without_truth):
    """Without truth the wrong token is stamped consistently; only where the request's cached
    slots (chained from the wrong token) meet a clean copy of the same prefix does a link fail:
    chain, at a sweep, long after the request delivered its tokens."""
    fault = ChunkBoundaryToken(seed=0, warmup_steps=WARMUP)
    out = run_once(small_setup(truth=False), [fault])
    (inj,) = fault.injections
    assert out.violations and judge(fault, fault.injections, out.violations).false_positives == 0
    assert all(v.point is LaunchPoint.SWEEP and v.reasons == Reason.CHAIN for v in out.violations)
    assert min(v.step for v in out.violations) > inj.step + 8
    assert clean_without_truth.violations == []


def test_position_skew_reports_every_written_position():
    fault = PositionSkew(seed=1, warmup_steps=WARMUP)
    out = run_once(small_setup(), [fault])
    (inj,) = fault.injections
    lo, hi = map(int, re.search(r"positions (\d+)\.\.(\d+)", inj.detail).groups())
    at_head = [v for v in out.violations if v.step == inj.step]
    assert len(at_head) == hi - lo + 1 and {v.slot for v in at_head} <= inj.affected_slots
    assert all(v.point is LaunchPoint.HEAD and v.reasons == Reason.WRITE_POSITION for v in at_head)
    assert all(v.stored_value == v.expected_value + 1 for v in at_head)  # stored: written; expected: prefix + j
    later = [v for v in out.violations if v.step > inj.step]
    assert later and all(v.reasons & ~(Reason.POSITION | Reason.WRITE_POSITION) == 0 for v in later)
    assert judge(fault, fault.injections, out.violations).false_positives == 0


def test_position_skew_rejects_a_zero_offset():
    with pytest.raises(ConfigError, match="offset"):
        PositionSkew(offset=0)
