"""The recompute guarantee when a client goes away: a request aborted after it read damaged K/V
but before the (one step late) report of that step arrived delivers nothing sampled from the
damaged forward."""

from __future__ import annotations

from kvcanary.engine.engine import Engine
from kvcanary.faults import FAULTS
from kvcanary.faults.hooks import attach_faults
from kvcanary.runs.driver import run_workload

from .test_delivery import Delivered, assert_delivered_clean, recompute_setup, run_delivered


def run_aborting_readers(setup, fault=None, plan: dict[int, int] | None = None,
                         lag: int = 1) -> tuple[Delivered, dict[int, int]]:
    """Drive the workload; in the tick after the step whose forward first read the fault's damage,
    abort every running request that holds the damaged slot, before that step's report is read
    (without a fault: abort the requests of ``plan`` after the steps it names). Returns the run and,
    per aborted request, the step after which it was aborted."""
    engine, hooks, _ = attach_faults(lambda h: Engine(setup.model, setup.engine, h), setup.canary,
                                     [fault] if fault else [])
    for canary in (hooks.canary, hooks.window_canary):
        if canary is not None:
            canary.reporter.lag = lag
    engine.delivery.lag = lag
    aborted: dict[int, int] = {}
    done: set[int] = set()

    def on_tick(result) -> None:
        step = engine.step_index - 1  # the step that just ran
        for rid, at in (plan or {}).items():
            if at == step and engine.abort(rid):
                aborted[rid] = step
        for inj in fault.injections if fault else ():
            if id(inj) in done or step != inj.step + 1:
                continue
            done.add(id(inj))
            for req in list(engine.scheduler.running):
                if inj.slot in set(req.slots.tolist()) and engine.abort(req.request_id):
                    aborted[req.request_id] = step

    run_workload(engine, setup.workload, on_tick=on_tick)
    hooks.flush(engine.step_index)
    recovered = engine.stats.num_recomputes + engine.stats.num_quarantined_slots
    return Delivered(engine.delivery.tokens(), engine.delivery.retracted, recovered, True, engine), aborted


def late_deliveries(got: Delivered, aborted: dict[int, int]) -> dict[int, list[int]]:
    """Per aborted request, the steps of its delivered tokens sampled at or after its abort step."""
    out = {}
    for rid, step in aborted.items():
        steps = got.engine.requests[rid].output_steps[: len(got.tokens.get(rid, []))]
        if late := [s for s in steps if s >= step]:
            out[rid] = late
    return out


def test_an_aborted_reader_delivers_nothing_from_the_damaged_forward():
    fault_free = run_delivered(recompute_setup(), lag=1)
    fault = FAULTS["used_slot_flip"](probability=0.3, seed=3, warmup_steps=8, max_injections=3)
    got, aborted = run_aborting_readers(recompute_setup(), fault)
    assert fault.injections and aborted, "no reader of the damage was aborted: the test would prove nothing"
    assert got.recovered > 0
    assert_delivered_clean(got, fault_free)
    assert late_deliveries(got, aborted) == {}


def test_its_twin_without_the_fault_delivers_the_same_aborted_requests_tokens():
    """The same aborts without the fault: the tokens sampled in the step before each abort are
    delivered (so the check above can fail), and nothing is recovered."""
    fault = FAULTS["used_slot_flip"](probability=0.3, seed=3, warmup_steps=8, max_injections=3)
    _, plan = run_aborting_readers(recompute_setup(), fault)
    got, aborted = run_aborting_readers(recompute_setup(), plan=plan)
    assert aborted == plan and got.recovered == 0 and got.retracted == 0
    assert set(late_deliveries(got, aborted)) == set(plan)
