"""The reporting pipeline: violation line and regex, JSON form, owners, and a live run's log."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from kvcanary.config import Policy
from kvcanary.core.hashing import MASK64
from kvcanary.core.record import Half, LaunchPoint, LaunchTag, PoolKind, Reason, ViolationRow
from kvcanary.faults import PageTableRepoint
from kvcanary.runs.single import run_once
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.reporting import VIOLATION_RE, StepMeta, Violation, owners_of

from ._helpers import small_setup


def violation(**overrides) -> Violation:
    fields = dict(step=12, tag=LaunchTag(LaunchPoint.HEAD), reasons=Reason.CHAIN | Reason.POSITION, slot=183,
                  position=5, token=17, expected_token=-1, stored_value=-0x1F00000000000001,
                  expected_value=0x1A2B3C4D5E6F7081, owners=((7, 5), (9, 5)))
    return Violation(**(fields | overrides))


def parse(line: str) -> dict:
    m = VIOLATION_RE.match(line)
    assert m is not None, line
    return m.groupdict()


@pytest.mark.parametrize("owners", [((7, 5), (9, 5)), (("cache", 40),), ()])
def test_line_round_trips_through_the_regex(owners):
    v = violation(owners=owners)
    g = parse(v.line())
    assert int(g["step"]) == v.step and g["tag"] == "HEAD.FULL.K"
    assert Reason.parse(g["reason"]) == v.reasons
    assert (int(g["slot"]), int(g["position"]), int(g["token"]), int(g["expected_token"])) == (183, 5, 17, -1)
    assert int(g["stored"], 16) == v.stored_value & MASK64 and int(g["expected"], 16) == v.expected_value
    pairs = [p.split("@") for p in g["requests"].split(",")] if g["requests"] else []
    assert [(r, int(p)) for r, p in pairs] == [(str(r), p) for r, p in owners]


@pytest.mark.parametrize("point", list(LaunchPoint))
@pytest.mark.parametrize("pool", list(PoolKind))
@pytest.mark.parametrize("half", list(Half))
def test_every_tag_and_reason_parses(point, pool, half):
    for bits in [*Reason, Reason(0b111111), Reason.FINGERPRINT | Reason.VERIFY_TOKEN]:
        g = parse(violation(tag=LaunchTag(point, pool, half), reasons=bits, slot=-1, position=-1).line())
        assert g["tag"] == f"{point.name}.{pool.name}.{half.name}" and Reason.parse(g["reason"]) == bits


def test_to_json_fields():
    out = violation(tag=LaunchTag(LaunchPoint.SWEEP, PoolKind.SWA, Half.V), owners=(("cache", 3),)).to_json()
    assert out == {"step": 12, "tag": "SWEEP.SWA.V", "launch_point": "SWEEP", "pool": "SWA",
                   "reasons": ["chain", "position"], "slot": 183, "position": 5, "token": 17, "expected_token": -1,
                   "stored_value": -0x1F00000000000001, "expected_value": 0x1A2B3C4D5E6F7081,
                   "requests": [{"request": "cache", "position": 3}], "layer": None, "sources": []}
    json.dumps(out)
    fp = violation(tag=LaunchTag(LaunchPoint.TAIL, half=Half.V), reasons=Reason.FINGERPRINT,
                   sources=((31, Half.V), (2, Half.K))).to_json()
    assert (fp["tag"], fp["layer"], fp["sources"]) == ("TAIL.FULL.V", 31, [{"layer": 31, "half": "V"},
                                                                          {"layer": 2, "half": "K"}])
    assert violation().requests == (7, 9) and violation(owners=(("cache", 1), (4, 2))).requests == (4,)


def _batch(request_ids=(10, 11, 99)) -> ForwardBatch:
    """Rows 1 and 2 share slots 5, 6 (a cached prefix); row 0 is a padding request."""
    table = torch.zeros(4, 8, dtype=torch.int32)
    table[1, :5] = torch.tensor([5, 6, 7, 8, 42])  # position 4 lies beyond the request's end
    table[2, :3] = torch.tensor([5, 6, 9])
    table[0, 0] = 5  # padding row: never an owner
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)
    return ForwardBatch(req_pool_indices=i64([1, 2, 0]), prefix_lens=i64([3, 2, 0]), extend_lens=i64([1, 1, 1]),
                        req_to_token=table, input_ids=i64([1, 2, 0]), positions=i64([3, 2, 0]),
                        out_cache_loc=i64([8, 9, 0]), request_ids=request_ids)


def _row(point: LaunchPoint, slot: int) -> ViolationRow:
    return ViolationRow(LaunchTag(point), slot, 0, 0, -1, 0, 0, Reason.CHAIN)


@pytest.mark.parametrize("slot, owners", [(6, ((10, 1), (11, 1))), (8, ((10, 3),)), (9, ((11, 2),)),
                                          (42, ()), (0, ()), (77, ())])
def test_owners_are_the_requests_that_hold_the_slot(slot, owners):
    meta = StepMeta(3, batch=_batch())
    for point in (LaunchPoint.HEAD, LaunchPoint.TAIL):
        assert owners_of(meta, _row(point, slot)) == owners


def test_owners_without_request_ids_are_batch_indices_and_sweeps_name_the_cache():
    assert owners_of(StepMeta(0, batch=_batch(None)), _row(LaunchPoint.HEAD, 5)) == ((0, 0), (1, 0))
    meta = StepMeta(0, sweep_slots={77: 40})
    assert owners_of(meta, _row(LaunchPoint.SWEEP, 77)) == (("cache", 40),)
    assert owners_of(meta, _row(LaunchPoint.SWEEP, 78)) == ()
    assert owners_of(StepMeta(0), _row(LaunchPoint.HEAD, 5)) == ()


def test_a_live_run_logs_parseable_lines_naming_the_damaged_request(caplog):
    fault = PageTableRepoint(seed=1, warmup_steps=20)
    with caplog.at_level(logging.DEBUG, logger="kvcanary"):
        out = run_once(small_setup(policy=Policy.LOG), [fault])
    records = [r for r in caplog.records if r.getMessage().startswith("kv_canary violation")]
    lines = [r.getMessage() for r in records]
    assert len(lines) == len(out.violations) == out.hooks.canary.totals.violations > 0
    # WARNING for the violations that open an incident, DEBUG for re-detections of an open one
    incidents = out.hooks.canary.incidents
    warned = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    opening = [v for v in out.violations if any(i.first is v for i in incidents.history)]
    assert warned == [v.line() for v in opening] and 0 < len(warned) < len(lines)
    parsed = [parse(line) for line in lines]
    victim = fault.injections[0].detail.split()[0].removeprefix("request=")
    first = parsed[0]
    assert first["tag"].startswith("HEAD") and int(first["step"]) == fault.injections[0].step
    assert victim in [p.split("@")[0] for p in first["requests"].split(",")]
    assert [int(g["slot"]) for g in parsed] == [v.slot for v in out.violations]


class _CountingPublication:
    """A publication that counts its own launches (the device's sequence word, kept on the host)."""

    def __init__(self):
        self.expected = self.seq = self.launches = 0

    def launch(self) -> None:
        self.launches += 1
        self.seq += 1


@pytest.mark.parametrize("replays", [0, 2])
@pytest.mark.parametrize("tails", [0, 1, 3])
@pytest.mark.parametrize("current", [False, True])
def test_a_snapshot_counts_every_publication_and_launches_one_only_where_none_is_current(replays, tails, current):
    """Replays publish from their graphs, eager TAILs from their launches (``published``); the
    snapshot launches one more unless a replay or a current TAIL's publication carries the step's
    counters, and expects the device's sequence word exactly."""
    from kvcanary.ops.state import DeviceState
    from kvcanary.runtime.reporting import Reporter

    state = DeviceState.allocate(8)
    reporter = Reporter(state.ring, state.ring_counter, state.stats, error=state.error, block=state.counter_block())
    pub = reporter.publication = _CountingPublication()
    for step in range(3):
        pub.seq += replays + tails  # what the graphs and the TAILs published on the device
        for _ in range(tails):
            reporter.published()
        reporter.snapshot(StepMeta(step), replays, current)
        launched = not replays and not (current and tails)
        assert pub.launches == (step + 1) * launched
        assert pub.expected == pub.seq


class _HostPublication:
    """``runtime.snapshots.Publication``'s ring on the host: ``launch`` publishes the counter block
    as the device would (``[seq, block...]`` into row ``seq % rows``); ``read_into``, the reader's
    wait and fallback, only counts (a clean run never needs it)."""

    def __init__(self, block: torch.Tensor, num_rows: int = 4):
        import numpy as np

        self.block, self.seq, self.expected, self.waits = block, 0, 0, 0
        self.view = np.full((num_rows, 1 + block.numel()), -1, dtype=np.int64)
        self.words = memoryview(self.view.reshape(-1))
        self.num_rows, self.width = self.view.shape

    def launch(self) -> None:
        self.seq += 1
        self.view[self.seq % self.num_rows] = [self.seq, *self.block.tolist()]

    def read_into(self, seq: int, out) -> None:
        self.waits += 1
        out[:] = self.words[seq % self.num_rows * self.width + 1: (seq % self.num_rows + 1) * self.width]


@pytest.mark.parametrize("seed", range(4))
def test_each_published_step_is_read_a_step_late_under_its_own_step(seed):
    """The replayed steps' clean path (``Reporter.advance`` reusing the snapshot it reads, the
    publication read in place): every violation row a step appends is handed out at the next
    step, named with the step that appended it, once; nothing is read through the wait."""
    import random

    from kvcanary.core.record import COL_REASONS, COL_SLOT, COL_STORED_POSITION, COL_TAG
    from kvcanary.ops.state import DeviceState
    from kvcanary.runtime.reporting import Reporter

    rng = random.Random(seed)
    state = DeviceState.allocate(64)
    state.ring.zero_()
    reporter = Reporter(state.ring, state.ring_counter, state.stats, error=state.error, block=state.counter_block())
    reporter.lag = 1  # a CUDA reporter's lag, on host buffers
    pub = reporter.publication = _HostPublication(state.counter_block())
    appended: dict[int, list[int]] = {}
    got: dict[int, list[int]] = {}
    for step in range(24):
        slots = [rng.randrange(1, 64) for _ in range(rng.choice((0, 0, 1, 3)))]  # the "device" appends rows
        for slot in slots:
            row = state.ring[int(state.ring_counter[0])]
            row[COL_TAG], row[COL_SLOT], row[COL_STORED_POSITION] = LaunchTag(LaunchPoint.TAIL).value, slot, step
            row[COL_REASONS] = int(Reason.CHAIN)
            state.ring_counter[0] += 1
        appended[step] = slots
        pub.launch()  # the step's graph publishes its counters
        for v in reporter.advance(StepMeta(step), replays=1):
            got.setdefault(v.step, []).append(v.slot)
            assert v.position == v.step  # the row's own step, the one its snapshot named
        assert all(got.get(s, []) == appended[s] for s in range(step))  # a step late, each row once
        assert step not in got
    assert pub.waits == 0 and pub.expected == pub.seq
