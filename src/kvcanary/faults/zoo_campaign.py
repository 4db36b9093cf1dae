"""Run each real-bug zoo switch (``kvcanary.engine.zoo``) on a workload that triggers it, and
judge what the canary reported like a fault's run.

``zoo_cases(...)`` builds one ``ZooCase`` per bug from the built-in workload and its engine
config: the bug's switch on, plus what its trigger needs (``RECIPES``: page size 4 with a system
prompt one page long or one token past two pages, no host tier, padding to captured batch
sizes, speculative drafts, a smaller pool). ``run_zoo_case`` runs it with a ``ZooTracker``,
which turns each logged act of the switch into an ``Injection`` (so ``judge`` tells the
violations the bug explains from false positives); ``run_zoo`` runs them all.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvcanary.config import CanaryConfig
from kvcanary.core.record import LaunchPoint, format_reasons
from kvcanary.engine.config import ModelConfig, SamplerKind
from kvcanary.engine.engine import Engine
from kvcanary.engine.workload import Progress, WorkloadConfig, builtin_workload, engine_config_for, run_workload
from kvcanary.engine.zoo import CATALOGUE, Bug, ZooEvent
from kvcanary.errors import CanaryViolation
from kvcanary.faults.base import Expectation, Fault, Injection
from kvcanary.faults.campaign import RunOutcome, RunSetup, Verdict, judge, partial_counts
from kvcanary.faults.hooks import attach_faults
from kvcanary.runtime.canary import WatchdogTimeout
from kvcanary.runtime.reporting import Violation

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class ZooExpectation(Expectation):
    """An expectation whose first violation may also come at the launch points ``also_at``."""

    also_at: tuple[LaunchPoint, ...] = ()

    def is_met_by(self, v: Violation) -> bool:
        return any(Expectation(p, self.reasons, self.optional).is_met_by(v) for p in (self.point, *self.also_at))

    def describe(self) -> str:
        return f"{format_reasons(self.reasons)} @ {'/'.join(p.name for p in (self.point, *self.also_at))}"


@dataclass(eq=False)
class ZooInjection(Injection):
    """An act of a zoo switch; request-scoped acts also explain violations on the positions they
    got wrong (``affected_positions``: (request id, position))."""

    affected_positions: set[tuple[int, int]] = field(default_factory=set)

    def explains(self, v: Violation) -> bool:
        return super().explains(v) or (v.step >= self.step and any(o in self.affected_positions for o in v.owners))


class ZooTracker(Fault):
    """Follows one zoo switch through a run: never acts itself; every event the engine logs
    becomes an injection at the step it was seen, and the damage is followed through offload,
    load-back and broken chain links (of requests and of cached runs)."""

    def __init__(self, bug: Bug):
        super().__init__()
        info = CATALOGUE[bug]
        self.bug, self.name = bug, bug.value
        self.expected = ZooExpectation(info.point, info.reasons, info.optional, info.also_at)
        self._num_seen = 0
        self._unresolved: list[tuple[ZooInjection, ZooEvent]] = []  # positions not backed by slots yet

    def poll(self) -> None:
        """Turn new events into injections; add the slots of request positions once they exist."""
        events: list[ZooEvent] = self.engine.zoo.events
        for e in events[self._num_seen:]:
            inj = ZooInjection(e.bug.value, self.engine.step_index, e.slots[0] if e.slots else -1, e.detail,
                               {s for s in e.slots if s > 0}, set(e.host_rows))
            if e.request_id is not None:
                inj.affected_positions = {(e.request_id, p) for p in e.positions}
                self._unresolved.append((inj, e))
            self.injections.append(inj)
        self._num_seen = len(events)
        if self._unresolved:
            self._unresolved = [(inj, e) for inj, e in self._unresolved if not self._resolve(inj, e)]

    def _resolve(self, inj: ZooInjection, e: ZooEvent) -> bool:
        req = self.engine.requests.get(e.request_id)
        if req is None or not req.is_active:
            return True  # gone: nothing left to resolve
        if req.capacity <= max(e.positions):
            return False
        inj.affected_slots |= {int(req.slots[p]) for p in e.positions}
        return True

    def before_forward(self, batch, step: int) -> None:
        self.poll()

    def after_forward(self, batch, step: int) -> None:
        self.poll()

    def on_report(self, request_ids: Sequence, tables: torch.Tensor, violations: list[Violation]) -> None:
        """Damage spreads along chain links: a violation on a slot whose predecessor (in the page
        table of a request that read it, or in its prefix-cache node) is affected is explained by
        the earliest injection that affected the predecessor."""
        self.poll()
        if not self.injections:
            return
        rows, index = tables.tolist(), {rid: i for i, rid in enumerate(request_ids)}
        cached_pred = self._cached_predecessors() if any(v.point is LaunchPoint.SWEEP for v in violations) else {}
        affected = set().union(*(inj.affected_slots for inj in self.injections))
        for v in violations:
            preds = {rows[index[r]][p - 1] for r, p in v.owners if r in index and p > 0}
            if v.slot in cached_pred:
                preds.add(cached_pred[v.slot])
            if v.slot in affected or not preds & affected:
                continue
            affected.add(v.slot)
            for inj in self.injections:
                if v.step < inj.step:
                    break
                if v.slot in inj.affected_slots:
                    break
                if preds & inj.affected_slots:
                    inj.affected_slots.add(v.slot)
                    break

    def _cached_predecessors(self) -> dict[int, int]:
        """Slot -> the slot before it, for every device-resident prefix-cache node."""
        tree, pred = self.engine.tree, {}
        if tree is None:
            return pred
        for node in tree.nodes():
            if node.is_on_host:
                continue
            slots = node.slots.tolist()
            parent = node.parent
            prev = int(parent.slots[-1]) if parent is not tree.root and not parent.is_on_host else -1
            pred.update(zip(slots, [prev, *slots[:-1]], strict=True))
        return pred

    def on_offload(self, device_slots: torch.Tensor, host_rows: torch.Tensor) -> None:
        self.poll()
        super().on_offload(device_slots, host_rows)

    def on_load(self, host_rows: torch.Tensor, device_slots: torch.Tensor) -> None:
        self.poll()
        super().on_load(host_rows, device_slots)

    def on_free(self, slots: torch.Tensor) -> None:
        self.poll()


@dataclass(frozen=True)
class ZooCase:
    bug: Bug
    setup: RunSetup


# what each trigger needs beyond the built-in workload: (workload overrides, engine overrides)
RECIPES: dict[Bug, tuple[dict, dict]] = {
    Bug.PREFIX_PAGE_OFF_BY_ONE: ({"system_prompt_len": 4}, {"page_size": 4}),  # prefix hits of one page
    Bug.PARTIAL_PAGE_HIT: ({"system_prompt_len": 9}, {"page_size": 4}),  # the third page starts alike
    Bug.STALE_RADIX_NODE: ({}, {"host_tier_slots": 0}),  # eviction drops nodes
    Bug.PADDING_WRITES_LIVE_SLOT: ({}, {"graph_batch_sizes": GRAPH_BATCH_SIZES}),
    Bug.REJECTED_DRAFT_KV_CACHED: ({}, {"sampler": SamplerKind.ORACLE, "num_draft_tokens": 3}),
    # load-backs under pressure, of system prompts that come back
    Bug.LOAD_BACK_UNORDERED: ({"num_system_prompts": 6, "block_size": 2}, {"num_slots": 448, "host_tier_slots": 448}),
}


def zoo_cases(model: ModelConfig, canary: CanaryConfig, workload: WorkloadConfig, device: str = "cpu",
              bugs: Sequence[Bug] = tuple(Bug)) -> list[ZooCase]:
    """One case per bug: the built-in ``workload`` and its engine config (``engine_config_for``)
    with the bug's switch on and its ``RECIPES`` entry applied."""
    cases = []
    for bug in bugs:
        workload_overrides, engine_overrides = RECIPES.get(bug, ({}, {}))
        w = builtin_workload(dataclasses.replace(workload, **workload_overrides))
        engine = engine_config_for(w, device, bugs=frozenset({bug}), **engine_overrides)
        cases.append(ZooCase(bug, RunSetup(model, engine, canary, w)))
    return cases


def twin(case: ZooCase) -> RunSetup:
    """The case's setup with its switch off: the same workload and engine features, no bug."""
    return dataclasses.replace(case.setup, engine=dataclasses.replace(case.setup.engine, bugs=frozenset()))


def run_zoo_case(case: ZooCase, progress: Progress | None = None) -> tuple[Verdict, RunOutcome]:
    """Run ``case`` with its tracker and judge the outcome. A host-side invariant the bug breaks
    (an ``AssertionError`` of the engine) stops the run like the raise policy does; the
    violations reported until then are judged."""
    tracker = ZooTracker(case.bug)
    out = run_setup(case.setup, [tracker], progress)
    return judge(tracker, tracker.injections, out.violations), out


def run_setup(setup: RunSetup, faults: Sequence[Fault] = (), progress: Progress | None = None) -> RunOutcome:
    """``campaign.run_once``, also stopping at an engine assertion (a broken host invariant)."""
    s = setup
    engine, hooks, fault_hooks = attach_faults(lambda h: Engine(s.model, s.engine, h), s.canary, faults)
    error, extra, alarms, t0 = None, [], [], time.perf_counter()
    try:
        counts = run_workload(engine, s.workload, progress)
        final = hooks.canary.flush(engine.step_index)
        extra, alarms = final.violations, final.alarms
    except (CanaryViolation, WatchdogTimeout, AssertionError) as e:
        error = f"{type(e).__name__}: {e}" if isinstance(e, AssertionError) else str(e)
        extra = getattr(e, "violations", [])
        counts = partial_counts(engine, time.perf_counter() - t0)
    violations = [v for r in hooks.reports for v in r.violations] + list(extra)
    alarms = [a for r in hooks.reports for a in r.alarms] + list(alarms)
    return RunOutcome(engine, hooks, counts, violations, fault_hooks.injections, time.perf_counter() - t0, error,
                      alarms)


def run_zoo(cases: Sequence[ZooCase], progress: Callable[[str], Progress | None] | None = None) -> list[Verdict]:
    """One judged run per case. ``progress(label)`` may return a per-run progress callback."""
    bar = progress or (lambda label: None)
    return [run_zoo_case(case, bar(case.bug.value))[0] for case in cases]
