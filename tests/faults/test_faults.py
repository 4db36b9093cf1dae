"""Every fault is detected with its exact reasons at its launch point; its clean twin is silent."""

from __future__ import annotations

import logging

import pytest

from kvcanary.core.record import Half, LaunchPoint, LaunchTag, Reason
from kvcanary.engine.engine import Engine
from kvcanary.engine.hooks import EngineHooks
from kvcanary.errors import ConfigError
from kvcanary.faults import (
    FAULTS,
    CachedSlotFlip,
    Expectation,
    Fault,
    FaultHooks,
    PageTableRepoint,
    StaleSlotReuse,
    UsedSlotFlip,
    WrongLayerWrite,
)
from kvcanary.faults.judge import judge
from kvcanary.ops.fingerprint import FingerprintMode
from kvcanary.runs.driver import run_workload
from kvcanary.runs.single import run_once
from kvcanary.runtime.reporting import Violation

from ._helpers import small_setup

WARMUP = 24
LOAD_BACK = None  # detected in the step its damaged host row is loaded back (see test_host_faults)
EXACT = {  # first violation: launch point, every reason, steps after the injection; token truth and
    # partial fingerprints on. Per-forward faults: within one step; sweep-only: at the next sweep.
    "page_table_repoint": (LaunchPoint.HEAD, Reason.CHAIN | Reason.POSITION | Reason.VERIFY_TOKEN, 0),
    "used_slot_flip": (LaunchPoint.TAIL, Reason.FINGERPRINT, 1),
    "cached_slot_flip": (LaunchPoint.SWEEP, Reason.FINGERPRINT, 0),
    "written_slot_flip": (LaunchPoint.TAIL, Reason.FINGERPRINT, 1),
    "sampled_token_swap": (LaunchPoint.HEAD, Reason.WRITE_TOKEN, 0),
    "position_skew": (LaunchPoint.HEAD, Reason.WRITE_POSITION, 0),
    "chunk_boundary_token": (LaunchPoint.HEAD, Reason.WRITE_TOKEN, 0),
    "stamp_corruption": (LaunchPoint.HEAD, Reason.CHAIN, 0),
    "host_row_flip": (LaunchPoint.SWEEP, Reason.FINGERPRINT, LOAD_BACK),
    "host_row_mismatch": (LaunchPoint.SWEEP, Reason.CHAIN | Reason.POSITION, LOAD_BACK),
    "stale_slot_reuse": (LaunchPoint.HEAD, Reason.READ_CONFLICT, 0),
    "page_table_bad_entry": (LaunchPoint.HEAD, Reason.BAD_ENTRY, 0),
    "write_target_duplicate": (LaunchPoint.HEAD, Reason.WRITE_CONFLICT, 0),
    "dropped_kv_write": (LaunchPoint.TAIL, Reason.MISSED_WRITE, 0),
    "wrong_layer_write": (LaunchPoint.TAIL, Reason.MISSED_WRITE, 0),
}


@pytest.fixture(scope="module")
def clean():
    return run_once(small_setup())


def test_clean_twin_is_silent(clean):
    assert clean.violations == [] and clean.injections == [] and clean.alarms == []


def test_every_fault_has_an_exact_expectation():
    assert set(EXACT) == set(FAULTS)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(FAULTS))
def test_fault_is_detected_exactly(name, seed, clean, caplog):
    fault = FAULTS[name](seed=seed, warmup_steps=WARMUP)
    with caplog.at_level(logging.WARNING, logger="kvcanary.faults"):
        out = run_once(small_setup(), [fault])
    (inj,) = fault.injections
    assert inj.step >= WARMUP and inj.slot > 0
    point, reasons, steps = EXACT[name]
    if steps is LOAD_BACK:  # acted on the host (slot -1), then its row landed in inj.slot
        steps = fault.load_step[inj] - inj.step
        logged = [f"fault {name}: step={inj.step} slot=-1", f"loaded back into slot {inj.slot}"]
    else:
        logged = [f"fault {name}: step={inj.step} slot={inj.slot}"]
    messages = [r.getMessage() for r in caplog.records if r.name == "kvcanary.faults"]
    assert all(any(line in m for m in messages) for line in logged), messages
    verdict = judge(fault, fault.injections, out.violations)
    assert verdict.detected and verdict.false_positives == 0, verdict
    assert verdict.first_detection == f"{'+'.join(Reason.names(reasons))} @ {point.name}"
    assert verdict.steps_to_detection == steps
    # the same workload without the fault reports nothing: every violation here is the fault's
    assert len(clean.violations) == 0 and out.counts.requests == clean.counts.requests


@pytest.mark.parametrize("name", list(FAULTS))
def test_as_on_cuda_the_verdict_is_the_same(name, as_on_cuda):
    """As on CUDA (each step's rows read at the end of the next, decode truth as appends): the
    same first detection, the same steps to it, no false positive."""
    on_time = FAULTS[name](seed=0, warmup_steps=WARMUP)
    expected = judge(on_time, on_time.injections, run_once(small_setup(), [on_time]).violations)
    as_on_cuda()
    fault = FAULTS[name](seed=0, warmup_steps=WARMUP)
    out = run_once(small_setup(), [fault])
    verdict = judge(fault, fault.injections, out.violations)
    assert out.hooks.canary.reporter.lag == 1 and out.engine.config.appends_truth
    assert verdict.detected and verdict.false_positives == 0, verdict
    assert (verdict.first_detection, verdict.steps_to_detection) == (expected.first_detection,
                                                                      expected.steps_to_detection)


@pytest.mark.parametrize("name", ["used_slot_flip", "cached_slot_flip", "written_slot_flip"])
def test_byte_flips_need_real_kv(name):
    out = run_once(small_setup(real_kv=FingerprintMode.NONE), [FAULTS[name](warmup_steps=WARMUP)])
    assert out.injections and out.violations == []  # the canary never reads K/V bytes in mode none


def test_byte_flip_anywhere_in_the_row_is_caught_with_real_kv_all():
    fault = UsedSlotFlip(seed=5, warmup_steps=WARMUP)
    out = run_once(small_setup(real_kv=FingerprintMode.ALL), [fault])
    assert judge(fault, fault.injections, out.violations).detected


def test_cached_slot_flip_only_acts_before_a_sweep():
    fault = CachedSlotFlip(warmup_steps=WARMUP)
    out = run_once(small_setup(sweep_interval=5), [fault])
    assert fault.injections[0].step % 5 == 0 and judge(fault, fault.injections, out.violations).detected
    idle = CachedSlotFlip(warmup_steps=0)
    out = run_once(small_setup(sweep_interval=0), [idle])
    assert idle.injections == [] and out.violations == []


def test_gate_probability_warmup_and_budget(caplog):
    never = PageTableRepoint(probability=0.0)
    late = StaleSlotReuse(warmup_steps=10_000)
    twice = PageTableRepoint(seed=4, warmup_steps=WARMUP, max_injections=2)
    out = run_once(small_setup(), [never, late, twice])
    assert never.injections == [] and late.injections == []
    assert [i.step for i in twice.injections] == [WARMUP, WARMUP + 1]
    assert out.violations and all(any(i.explains(v) for i in twice.injections) for v in out.violations)


def test_gate_rejects_bad_knobs():
    with pytest.raises(ConfigError, match="probability"):
        UsedSlotFlip(probability=1.5)
    with pytest.raises(ConfigError, match="warmup_steps"):
        UsedSlotFlip(warmup_steps=-1)


def test_skips_are_logged_with_the_reason(caplog):
    target = StaleSlotReuse(victim_id=10_000)  # no such request: never a target
    with caplog.at_level(logging.DEBUG, logger="kvcanary.faults"):
        run_once(small_setup(num_requests=8), [target])
    assert target.injections == []
    assert any("skipped: needs a prefill" in r.getMessage() for r in caplog.records)


def test_flip_freed_before_it_is_read_is_discarded_and_rearmed(caplog):
    """Request 8 of seed 2 is aborted the step after the flip: nobody reads its slot again."""
    fault = UsedSlotFlip(seed=2, warmup_steps=16)
    with caplog.at_level(logging.WARNING, logger="kvcanary.faults"):
        out = run_once(small_setup(seed=2), [fault])
    assert any("flip discarded, fault re-armed" in r.getMessage() for r in caplog.records)
    (inj,) = fault.injections
    assert inj.step > 16 and judge(fault, fault.injections, out.violations).detected


class Recorder(EngineHooks):
    def __init__(self, events):
        self.events = events

    def before_forward(self, batch):
        self.events.append("inner.before")

    def after_forward(self, batch):
        self.events.append("inner.after")

    def after_step(self, step_index):
        self.events.append("inner.step")


class RecordingFault(Fault):
    name = "recording"
    expected = Expectation(LaunchPoint.HEAD, Reason.CHAIN)

    def __init__(self, events):
        super().__init__()
        self.events = events

    def before_forward(self, batch, step):
        self.events.append(f"fault.before@{step}")

    def after_forward(self, batch, step):
        self.events.append(f"fault.after@{step}")


def test_fault_hooks_wrap_the_inner_hooks():
    events: list[str] = []
    setup = small_setup(num_requests=2)
    fault_hooks = FaultHooks(Recorder(events), [RecordingFault(events)])
    engine = Engine(setup.model, setup.engine, fault_hooks)
    fault_hooks.attach(engine)
    engine.add_request([1, 2, 3], 2)
    engine.step()
    engine.step()
    assert events == ["fault.before@0", "inner.before", "inner.after", "fault.after@0", "inner.step",
                      "fault.before@1", "inner.before", "inner.after", "fault.after@1", "inner.step"]
    assert fault_hooks.faults[0].engine is engine and fault_hooks.faults[0].canary is None


def test_expectation_is_exact():
    exp = Expectation(LaunchPoint.HEAD, Reason.CHAIN, Reason.POSITION)
    v = lambda point, bits: Violation(0, LaunchTag(point), Reason(bits), 5, 0, 0, 0, 0, 0)
    assert exp.is_met_by(v(LaunchPoint.HEAD, Reason.CHAIN))
    assert exp.is_met_by(v(LaunchPoint.HEAD, Reason.CHAIN | Reason.POSITION))
    assert not exp.is_met_by(v(LaunchPoint.TAIL, Reason.CHAIN))
    assert not exp.is_met_by(v(LaunchPoint.HEAD, Reason.POSITION))
    assert not exp.is_met_by(v(LaunchPoint.HEAD, Reason.CHAIN | Reason.FINGERPRINT))
    assert exp.describe() == "chain @ HEAD"


def test_run_workload_is_unchanged_by_a_fault_that_never_acts():
    setup = small_setup(num_requests=8)
    engine = Engine(setup.model, setup.engine, FaultHooks(EngineHooks(), [PageTableRepoint(probability=0.0)]))
    engine.hooks.attach(engine)
    counts = run_workload(engine, setup.workload)
    assert counts.requests == 8 and counts.finished + counts.aborted == 8


@pytest.mark.parametrize("name", ["dropped_kv_write", "wrong_layer_write"])
def test_missed_writes_need_real_kv(name):
    """Mode none marks nothing: the write that did not happen changes no check."""
    out = run_once(small_setup(real_kv=FingerprintMode.NONE), [FAULTS[name](warmup_steps=WARMUP)])
    assert out.injections and out.violations == []


@pytest.mark.parametrize(("from_layer", "to_layer", "seen"), [(1, 0, True), (0, 1, False)],
                         ids=["from_covered", "from_uncovered"])
def test_wrong_layer_write_is_seen_only_from_a_covered_layer(from_layer, to_layer, seen):
    """Only layer 1 covered: layer 1's K/V landing in layer 0 leaves layer 1 marked (MISSED_WRITE
    at TAIL, in the step); layer 0's landing in layer 1 is valid-looking K/V in a covered layer,
    invisible by design (its twin without the fault: the clean fixture)."""
    fault = WrongLayerWrite(from_layer=from_layer, to_layer=to_layer, warmup_steps=WARMUP)
    out = run_once(small_setup(layers=(1,)), [fault])
    assert fault.injections
    if seen:
        verdict = judge(fault, fault.injections, out.violations)
        assert verdict.detected and verdict.false_positives == 0, verdict
        assert verdict.first_detection == "missed_write @ TAIL" and verdict.steps_to_detection == 0
        first = min(out.violations, key=lambda v: v.step)
        assert first.stored_value == 0b11  # both of layer 1's sources (K and V) still hold the mark
        assert first.sources == ((1, Half.K), (1, Half.V)) and first.layer == 1
    else:
        assert out.violations == []
