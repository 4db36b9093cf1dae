"""Incidents: one damaged slot read for many steps is one incident and one WARNING line; the
re-detections are counted (violations, summary line); a rewritten or freed slot closes it, so new
damage there is a second incident. The clean twin reports nothing."""

from __future__ import annotations

import logging

import pytest
import torch

from kvcanary import Canary, CanaryConfig, ForwardBatch, Half, KVSource, PoolGeometry
from kvcanary.core.record import LaunchPoint, LaunchTag, Reason
from kvcanary.runtime.incidents import INCIDENTS_RE, IncidentTracker
from kvcanary.runtime.reporting import VIOLATION_RE, Violation

NUM_SLOTS, ROWS, MAX_CTX, PROMPT = 97, 4, 64, 8


class Decoder:
    """One request decoding through a canary: HEAD, the 'model' writes K/V of the new slot, TAIL."""

    def __init__(self, seed: int, **config):
        self.gen = torch.Generator().manual_seed(seed)
        self.k = torch.randn(NUM_SLOTS, 2, 8, generator=self.gen)
        self.v = torch.randn(NUM_SLOTS, 2, 8, generator=self.gen)
        sources = [KVSource.from_buffer(self.k, half=Half.K), KVSource.from_buffer(self.v, half=Half.V)]
        cfg = CanaryConfig(**({"sweep_interval": 0, "incident_summary_steps": 1000} | config))
        self.canary = Canary(cfg, PoolGeometry(NUM_SLOTS, ROWS, MAX_CTX), sources=sources)
        self.rtt = torch.zeros(ROWS, MAX_CTX, dtype=torch.int32)
        self.step = 0
        self.violations: list[Violation] = []

    def start(self, slots: list[int]) -> None:
        """A new request in row 1 whose positions map to ``slots``; prefills PROMPT tokens."""
        self.slots = slots
        self.rtt[1, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
        self.tokens = torch.randint(1, 500, (PROMPT,), generator=self.gen).tolist()
        self._forward(0, PROMPT)

    def decode(self, n: int) -> None:
        for _ in range(n):
            self.tokens.append(int(torch.randint(1, 500, (1,), generator=self.gen)))
            self._forward(len(self.tokens) - 1, 1)

    def _forward(self, prefix: int, extend: int) -> None:
        i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)
        written = self.slots[prefix: prefix + extend]
        batch = ForwardBatch(i64([1]), i64([prefix]), i64([extend]), self.rtt, i64(self.tokens[prefix:]),
                             torch.arange(prefix, prefix + extend), i64(written), i64(self.tokens),
                             i64([0, len(self.tokens)]), ("req",))
        with self.canary.forward(batch):
            for buf in (self.k, self.v):
                buf[written] = torch.randn(extend, 2, 8, generator=self.gen)
        report = self.canary.end_step(self.step)
        self.violations += report.violations
        self.step += 1

    def flip(self, position: int) -> None:
        self.k[self.slots[position], 0, 0] += 1.0


@pytest.fixture
def slots():
    return (torch.randperm(NUM_SLOTS - 1, generator=torch.Generator().manual_seed(7))[:40] + 1).tolist()


def _lines(caplog, level):
    return [r.getMessage() for r in caplog.records if r.levelno == level and r.name == "kvcanary"]


def test_one_flip_read_for_15_steps_is_15_violations_one_incident_one_warning_line(slots, caplog):
    d = Decoder(seed=1, incident_summary_steps=5)
    d.start(slots)
    d.decode(2)
    d.flip(3)
    with caplog.at_level(logging.DEBUG, logger="kvcanary"):
        d.decode(15)
        periodic = len(caplog.records)
        d.canary.flush(d.step)  # flush prints what the periodic lines had not yet
    assert len(d.violations) == 15
    assert {(v.slot, v.reasons, v.point) for v in d.violations} == {(slots[3], Reason.FINGERPRINT, LaunchPoint.TAIL)}
    assert d.canary.totals.violations == 15
    inc = d.canary.incidents
    assert inc.num_incidents == 1 and inc.redetections == 14 and len(inc.open_incidents()) == 1
    (incident,) = inc.history
    assert incident.slot == slots[3] and incident.reasons is Reason.FINGERPRINT and incident.detections == 15
    assert incident.first is d.violations[0] and incident.last_step == d.violations[-1].step and incident.is_open
    warnings = [m for m in _lines(caplog, logging.WARNING) if m.startswith("kv_canary violation")]
    assert warnings == [d.violations[0].line()] and VIOLATION_RE.match(warnings[0])
    debug = [m for m in _lines(caplog, logging.DEBUG) if m.startswith("kv_canary violation")]
    assert debug == [v.line() for v in d.violations[1:]]
    summaries = [INCIDENTS_RE.match(m) for m in _lines(caplog, logging.WARNING) if m.startswith("kv_canary incidents")]
    assert len(summaries) >= 2 and all(summaries)
    assert int(summaries[0]["new_incidents"]) == 1 and caplog.records[periodic].getMessage() == summaries[-1][0]
    assert sum(int(m["new_redetections"]) for m in summaries) == 14
    last = summaries[-1]
    assert int(last["incidents"]) == 1 and int(last["open"]) == 1 and int(last["redetections"]) == 14


def test_a_rewritten_slot_closes_its_incident_and_new_damage_is_a_second(slots):
    d = Decoder(seed=2)
    d.start(slots)
    d.flip(3)
    d.decode(4)
    (first,) = d.canary.incidents.history
    d.start(slots)  # the next request in the same slots: HEAD stamps slot 3 again
    assert not first.is_open and first.closed_by == "rewritten" and first.closed_step == d.step - 1
    d.decode(3)
    assert len(d.violations) == 4  # nothing while the slot is healthy again
    d.flip(3)
    d.decode(5)
    inc = d.canary.incidents
    assert len(d.violations) == 9 and inc.num_incidents == 2 and inc.redetections == 7
    assert [i.closed_by for i in inc.history] == ["rewritten", None]
    assert inc.by_label == {("fingerprint", "TAIL", "FULL"): 2}


def test_a_freed_slot_closes_its_incident(slots):
    d = Decoder(seed=3)
    d.start(slots)
    d.flip(5)
    d.decode(3)
    d.canary.slots_freed(torch.tensor(slots, dtype=torch.int64))
    d.canary.end_step(d.step)
    (incident,) = d.canary.incidents.history
    assert incident.closed_by == "freed" and not d.canary.incidents.open


def test_the_clean_twin_reports_no_violation_and_no_incident(slots, caplog):
    d = Decoder(seed=1)
    with caplog.at_level(logging.DEBUG, logger="kvcanary"):
        d.start(slots)
        d.decode(17)
        d.start(slots)
        d.decode(3)
    assert d.violations == [] and d.canary.incidents.num_incidents == 0
    assert not [r for r in caplog.records if r.getMessage().startswith(("kv_canary violation", "kv_canary incidents"))]


def test_metrics_count_incidents_beside_violations(slots):
    prometheus = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from kvcanary.runtime.metrics import CanaryCollector

    d = Decoder(seed=4)
    d.start(slots)
    d.flip(2)
    d.decode(6)
    registry = prometheus.CollectorRegistry()
    registry.register(CanaryCollector([d.canary]))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in
               text_string_to_metric_families(prometheus.generate_latest(registry).decode()) for s in fam.samples}
    key = (("launch_point", "TAIL"), ("pool", "FULL"), ("reason", "fingerprint"))
    assert samples["kvcanary_violations_total", key] == 6 and samples["kvcanary_incidents_total", key] == 1
    incidents = {k: v for k, v in samples.items() if k[0] == "kvcanary_incidents_total"}
    assert len(incidents) == len(Reason) * len(LaunchPoint) and sum(incidents.values()) == 1


def _violation(step: int, slot: int, reasons: Reason = Reason.CHAIN, position: int = 4) -> Violation:
    return Violation(step, LaunchTag(LaunchPoint.HEAD), reasons, slot, position, 1, 1, 0, 0, (("r", position),))


def test_closes_apply_in_step_order_when_violations_arrive_a_step_late():
    """CUDA reads violations one step late: a rewrite at step 6 must not close an incident before
    the violations of step 5 are in, and must close it before those of step 6."""
    t = IncidentTracker()
    t.observe([_violation(4, 9)], upto_step=4)
    t.note(6, torch.tensor([9, 10]), "rewritten")  # HEAD of step 6 stamps slot 9
    t.observe([_violation(5, 9)], upto_step=5)  # step 5's violations, read at step 6
    assert t.num_incidents == 1 and t.redetections == 1 and t.open
    t.observe([_violation(6, 9)], upto_step=6)  # step 6: after the rewrite, so new damage
    assert t.num_incidents == 2 and [i.closed_by for i in t.history] == ["rewritten", None]


def test_one_violation_opens_one_incident_and_a_new_reason_on_the_slot_opens_another():
    t = IncidentTracker()
    opened = t.observe([_violation(1, 9, Reason.CHAIN | Reason.POSITION)], upto_step=1)
    assert [i.reasons for i in opened[0][1]] == [Reason.CHAIN | Reason.POSITION]
    again = t.observe([_violation(2, 9, Reason.CHAIN), _violation(2, 9, Reason.CHAIN | Reason.VERIFY_TOKEN)], 2)
    assert again[0][1] == [] and [i.reasons for i in again[1][1]] == [Reason.VERIFY_TOKEN]
    assert t.num_incidents == 2 and t.redetections == 1 and opened[0][1][0].detections == 2
    assert t.by_label == {("chain", "HEAD", "FULL"): 1, ("position", "HEAD", "FULL"): 1,
                          ("verify_token", "HEAD", "FULL"): 1}
    t.note(3, torch.tensor([9]), "rewritten")
    t.observe([], upto_step=3)
    assert t.open_incidents() == [] and t.closed == 2


def test_slotless_violations_are_keyed_by_position_and_request():
    t = IncidentTracker()
    t.observe([_violation(2, -1, position=3), _violation(2, -1, position=3), _violation(2, -1, position=4)], 2)
    assert t.num_incidents == 2 and t.redetections == 1
    t.note(3, torch.tensor([5]), "freed")  # no open incident on slot 5: nothing queued
    assert not t._closes
