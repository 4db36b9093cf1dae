"""Edges of the runtime and the engine's delivery, counts asserted as numbers: one damaged slot
found at two launch points is one incident; a late recovery that drops tokens a client was
already sent counts exactly those tokens as retracted."""

from __future__ import annotations

import pytest
import torch
from tests.engine._helpers import make_engine, random_prompts

from kvcanary.core.record import LaunchPoint, LaunchTag, Reason, record_words
from kvcanary.engine.delivery import Delivery
from kvcanary.engine.request import Request
from kvcanary.runtime.incidents import IncidentTracker
from kvcanary.runtime.reporting import Violation

from .test_incidents import NUM_SLOTS, Decoder


def _violation(step: int, point: LaunchPoint, slot: int = 9, reasons: Reason = Reason.CHAIN) -> Violation:
    return Violation(step, LaunchTag(point), reasons, slot, 4, 1, 1, 0, 0, (("r", 4),))


def test_one_slot_found_at_two_launch_points_is_one_incident():
    """The same (slot, reason) at HEAD and at TAIL of one step, then at a SWEEP: one incident,
    two re-detections; another slot at TAIL is a second incident."""
    t = IncidentTracker()
    out = t.observe([_violation(3, LaunchPoint.HEAD), _violation(3, LaunchPoint.TAIL)], upto_step=3)
    assert [len(opened) for _, opened in out] == [1, 0]
    t.observe([_violation(4, LaunchPoint.SWEEP), _violation(4, LaunchPoint.TAIL, slot=10)], upto_step=4)
    assert t.num_incidents == 2 and t.redetections == 2
    first = t.history[0]
    assert first.detections == 3 and first.point is LaunchPoint.HEAD and first.last_step == 4
    assert t.by_label == {("chain", "HEAD", "FULL"): 1, ("chain", "TAIL", "FULL"): 1}


def test_bad_entries_naming_slot_0_are_one_incident_per_position_and_request():
    """A page-table entry 0 inside a request names no slot: its violations are keyed by position
    and requests too, so two such entries are two incidents, and the same one read again (at
    another launch point) is a re-detection."""
    t = IncidentTracker()

    def bad(step, point, position, request):
        return Violation(step, LaunchTag(point), Reason.BAD_ENTRY, 0, position, -1, -1, 1, 0, ((request, position),))

    t.observe([bad(2, LaunchPoint.HEAD, 3, "a"), bad(2, LaunchPoint.HEAD, 4, "a"), bad(2, LaunchPoint.HEAD, 3, "b"),
               bad(2, LaunchPoint.TAIL, 3, "a")], upto_step=2)
    assert t.num_incidents == 3 and t.redetections == 1


def test_a_damaged_record_read_at_head_and_tail_for_five_steps_is_one_incident():
    """A prefix slot's chain word flipped: HEAD and TAIL of each of 5 decode steps report it and
    its successor (whose link to it breaks): 20 violations, one incident per slot, each detected
    10 times (5 at each launch point). Its clean twin: none."""
    slots = (torch.randperm(NUM_SLOTS - 1, generator=torch.Generator().manual_seed(7))[:40] + 1).tolist()
    clean = Decoder(seed=5)
    clean.start(slots)
    clean.decode(5)
    assert clean.violations == [] and clean.canary.incidents.num_incidents == 0
    d = Decoder(seed=5)
    d.start(slots)
    record_words(d.canary.state.records)[slots[4], 2] ^= 1 << 33
    d.decode(5)
    points = [v.point for v in d.violations if v.slot == slots[4]]
    assert points.count(LaunchPoint.HEAD) == 5 and points.count(LaunchPoint.TAIL) == 5
    totals = d.canary.totals
    assert len(d.violations) == 20 and totals.violations == 20
    assert totals.by_launch_point == {"HEAD": 10, "TAIL": 10} and totals.by_reason == {"chain": 20}
    counters = d.canary.counters()  # the prefill and 5 decodes: a HEAD and a TAIL each
    assert [counters[p]["launches"] for p in ("HEAD", "TAIL", "SWEEP")] == [6, 6, 0]
    # HEAD and TAIL each check the prefix: 0 at the prefill, then 8, 9, ..., 12; HEAD stamps 8 + 5
    assert [counters[p]["checked"] for p in ("HEAD", "TAIL")] == [50, 50] and counters["HEAD"]["stamped"] == 13
    inc = d.canary.incidents
    assert inc.num_incidents == 2 and inc.redetections == 18
    assert sorted(i.slot for i in inc.history) == sorted([slots[4], slots[5]])
    assert [i.detections for i in inc.history] == [10, 10] and {i.point for i in inc.history} == {LaunchPoint.HEAD}


def _request(outputs: list[tuple[int, int]]) -> Request:
    req = Request(7, [1, 2, 3], 10)
    for step, token in outputs:
        req.output_ids.append(token)
        req.output_steps.append(step)
    return req


def test_delivery_counts_the_delivered_tokens_a_late_recovery_drops():
    """Five outputs sampled at steps 0..4 and delivered (no lag); a recovery from step 2 drops
    three delivered tokens: ``retracted`` is 3, then 3 + 1 after a second drop from step 1; a
    drop of undelivered outputs retracts nothing."""
    d = Delivery(lag=0)
    req = _request([(s, 100 + s) for s in range(5)])
    d.sampled(req, step=4)
    d.advance(4)
    assert d.count(7) == 5 and [x.token for x in d.log] == [100, 101, 102, 103, 104]
    assert req.drop_outputs_since(2) == 3
    d.dropped(req)
    assert d.retracted == 3 and d.count(7) == 2
    req.drop_outputs_since(1)
    d.dropped(req)
    assert d.retracted == 4 and d.count(7) == 1
    late = Delivery(lag=1)  # a step's outputs wait for its report: the last step's are not out yet
    req = _request([(s, 100 + s) for s in range(5)])
    late.sampled(req, step=4)
    late.advance(4)
    assert late.count(7) == 4 and not late.is_delivered(req, 4) and late.is_delivered(req, 3)
    req.drop_outputs_since(4)
    late.dropped(req)
    assert late.retracted == 0
    req.drop_outputs_since(2)
    late.dropped(req)
    assert late.retracted == 2


def test_an_engine_recovery_from_an_old_step_retracts_what_it_delivered_since():
    """The engine delivered each token at its step (no canary, no lag); a recompute told to start
    three steps back drops those three delivered tokens of the running request: retracted == 3,
    and the request re-prefills and finishes with its full output."""
    engine = make_engine(chunk_size=64)
    prompt = random_prompts(seed=31, num=1, min_len=6, max_len=6)[0]
    rid = engine.add_request(prompt, 8)
    for _ in range(6):
        engine.step()
    req = engine.requests[rid]
    assert len(req.output_ids) == 6 and engine.delivery.count(rid) == 6
    since = req.output_steps[3]
    assert engine.recompute([rid], [], since_step=since) == [rid]
    assert engine.delivery.retracted == 3 and len(req.output_ids) == 3
    engine.run_until_done()
    assert len(engine.output_ids(rid)) == 8


def test_a_real_requests_token_written_to_slot_0_is_a_bad_entry_at_head_on_the_default_path():
    """The default path of a CPU Canary (the compiled kernels where numba serves): a decode token
    written to the padding slot 0 is one BAD_ENTRY at HEAD naming slot 0, the position and the
    request; the same decode into a free slot (the twin) reports nothing."""
    from kvcanary.ops import _cpu

    slots = (torch.randperm(NUM_SLOTS - 1, generator=torch.Generator().manual_seed(8))[:20] + 1).tolist()
    twin = Decoder(seed=6)
    assert twin.canary.backend.value == ("numba" if _cpu.usable() else "torch")
    twin.start(slots)
    twin.decode(1)
    assert twin.violations == []
    d = Decoder(seed=6)
    d.start(slots[:8] + [0] + slots[9:])
    d.decode(1)
    assert [(v.point, v.reasons, v.slot, v.position, v.requests) for v in d.violations] == [
        (LaunchPoint.HEAD, Reason.BAD_ENTRY, 0, 8, ("req",))]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("how", ["recompute", "fail"])
def test_quarantine_starts_at_the_first_real_page_and_counts_its_slots(how, page_size):
    """``Engine.recompute`` and ``Engine.fail`` take bad slots in [0, num_slots): slots of the
    reserved page 0 are accepted and quarantine nothing; the first real slot (``page_size``)
    quarantines its page (``page_size`` slots counted); a slot outside the pool raises naming
    ``bad_slots`` before anything changes."""
    engine = make_engine(chunk_size=64, page_size=page_size)
    act = (lambda bad: engine.recompute([], bad)) if how == "recompute" else (lambda bad: engine.fail([], bad, 0))
    assert act(list(range(page_size))) == [] and engine.stats.num_quarantined_slots == 0
    for wild in ([-1], [engine.config.num_slots]):
        with pytest.raises(ValueError, match="bad_slots"):
            act(wild)
    assert engine.stats.num_quarantined_slots == 0
    act([page_size])
    assert engine.stats.num_quarantined_slots == page_size
    engine.check_integrity()


def test_a_flush_kept_by_a_server_keeps_only_a_report_that_found_something():
    """``CanaryHooks.flush(step, keep=True)`` (a server that goes on stepping): a clean report is
    not kept; a report with a violation is, once."""
    from kvcanary.config import CanaryConfig
    from kvcanary.engine.canary_hooks import attach_canary

    engine, hooks = attach_canary(lambda h: make_engine(hooks=h, chunk_size=64), CanaryConfig(sweep_interval=0))
    rid = engine.add_request(random_prompts(seed=32, num=1, min_len=6, max_len=6)[0], 4)
    for _ in range(3):
        engine.step()
    assert hooks.flush(engine.step_index, keep=True).violations == [] and hooks.reports == []
    slot = int(engine.requests[rid].slots[2])
    record_words(hooks.canary.state.records)[slot, 2] ^= 1
    engine.step()
    found = len(hooks.reports)
    assert found == 1 and len(hooks.reports[0].violations) == 4  # the slot and its successor, at HEAD and TAIL
    hooks.flush(engine.step_index, keep=True)
    assert len(hooks.reports) == found


def test_accepted_drafts_deliver_the_oracles_tokens_in_fewer_steps_with_a_clean_canary():
    """Speculative drafts under the oracle sampler (every draft is accepted): each request gets
    the oracle's tokens, in fewer steps than without drafts, and the canary (truth on) finds
    nothing: the accepted tokens' positions and slots are accounted right."""
    from kvcanary.config import CanaryConfig
    from kvcanary.engine import SamplerKind
    from kvcanary.engine.canary_hooks import attach_canary
    from kvcanary.engine.sampler import oracle_token

    prompts = random_prompts(seed=33, num=3, min_len=5, max_len=9)
    steps = {}
    for drafts in (0, 3):
        engine, hooks = attach_canary(lambda h, d=drafts: make_engine(hooks=h, sampler=SamplerKind.ORACLE,
                                                                      num_draft_tokens=d, chunk_size=64),
                                      CanaryConfig(sweep_interval=0))
        ids = [engine.add_request(p, 9) for p in prompts]
        steps[drafts] = engine.run_until_done()
        hooks.flush(engine.step_index)
        assert hooks.reports == [] and hooks.canary.totals.violations == 0
        for rid, p in zip(ids, prompts, strict=True):
            assert engine.output_ids(rid) == [oracle_token(rid, len(p) + i, 256) for i in range(9)]
        engine.check_integrity()
    assert steps[3] < steps[0]
