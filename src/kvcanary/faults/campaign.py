"""Run the built-in workload with the canary (and faults), and judge what the canary reported.

``run_once(setup, faults)`` builds a fresh engine and canary, drives the workload and collects
every violation. ``judge`` splits violations into those an injection explains and false
positives, and checks the first explained one against the fault's expectation.
``run_campaign`` is the self-test: a clean run, then one run per fault; faults that wait for an
engine feature (``PENDING_FAULTS``) are listed as pending, not run, and never fail it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvcanary.config import CanaryConfig
from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.engine.canary_hooks import CanaryHooks
from kvcanary.engine.config import EngineConfig, ModelConfig
from kvcanary.engine.engine import Engine
from kvcanary.engine.request import RequestStatus
from kvcanary.engine.workload import Progress, Workload, run_workload
from kvcanary.errors import CanaryViolation
from kvcanary.faults import FAULTS, PD_FAULTS, PENDING_FAULTS, WINDOW_FAULTS
from kvcanary.faults.base import Fault, Injection
from kvcanary.faults.hooks import attach_faults
from kvcanary.runtime.canary import WatchdogTimeout
from kvcanary.runtime.reporting import Violation

_LAUNCH_ORDER = {LaunchPoint.SWEEP: 0, LaunchPoint.HEAD: 1, LaunchPoint.TAIL: 2}  # within one step


@dataclass(frozen=True)
class RunSetup:
    model: ModelConfig
    engine: EngineConfig
    canary: CanaryConfig
    workload: Workload


@dataclass
class RunOutcome:
    engine: Engine
    hooks: CanaryHooks
    counts: dict
    violations: list[Violation]
    injections: list[Injection]
    wall_seconds: float
    error: str | None = None  # why the run stopped early (raise policy, watchdog)
    alarms: list = field(default_factory=list)
    timeline: dict = field(default_factory=dict)  # per step, see ``StepTimeline.to_json``


class StepTimeline:
    """Per-step counts of a run for its incident report: sweeps, evicted, offloaded and loaded-back
    slots (``observe`` after each driver tick), violations by reason (``to_json``, from their steps)."""

    COLUMNS = {"sweeps": None, "evicted_slots": "num_evicted_slots", "offloaded_slots": "num_offloaded_slots",
               "loaded_slots": "num_loaded_slots"}

    def __init__(self, engine: Engine, hooks: CanaryHooks):
        self.engine, self.hooks = engine, hooks
        self.rows: list[dict[str, int]] = []
        self._last = self._totals()

    def _totals(self) -> dict[str, int]:
        stats = self.engine.stats
        return {k: self.hooks.canary.totals.sweeps if attr is None else getattr(stats, attr)
                for k, attr in self.COLUMNS.items()}

    def observe(self) -> None:
        now = self._totals()
        while len(self.rows) < self.engine.step_index:  # one tick runs at most one step
            self.rows.append({k: now[k] - self._last[k] for k in now})
            self._last = now

    def to_json(self, violations: Sequence[Violation]) -> dict:
        """``{"steps": n, "sweeps": [n ints], ..., "violations": {reason: [n ints]}}``; index = step."""
        self.observe()
        n = max([len(self.rows)] + [v.step + 1 for v in violations])
        out: dict = {"steps": n}
        for k in self.COLUMNS:
            out[k] = [r[k] for r in self.rows] + [0] * (n - len(self.rows))
        by_reason: dict[str, list[int]] = {}
        for v in violations:
            for name in Reason.names(v.reasons):
                by_reason.setdefault(name, [0] * n)[v.step] += 1
        out["violations"] = dict(sorted(by_reason.items()))
        return out


def run_once(setup: RunSetup, faults: Sequence[Fault] = (), progress: Progress | None = None) -> RunOutcome:
    """A fresh engine with the canary (and ``faults``) through the workload. A ``CanaryViolation``
    or ``WatchdogTimeout`` stops the run; it is kept in ``error``, its violations in ``violations``."""
    engine, hooks, fault_hooks = attach_faults(lambda h: Engine(setup.model, setup.engine, h), setup.canary, faults)
    error, extra, t0 = None, [], time.perf_counter()
    timeline = StepTimeline(engine, hooks)

    def tick(done: int, total: int) -> None:
        timeline.observe()
        if progress is not None:
            progress(done, total)

    try:
        counts = run_workload(engine, setup.workload, tick)
        final = hooks.flush(engine.step_index)  # both pools
        extra, alarms = final.violations, final.alarms
    except (CanaryViolation, WatchdogTimeout) as e:
        error, extra, alarms = str(e), getattr(e, "violations", []), []
        counts = partial_counts(engine, time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    violations = [v for r in hooks.reports for v in r.violations] + list(extra)
    alarms = [a for r in hooks.reports for a in r.alarms] + list(alarms)
    return RunOutcome(engine, hooks, counts, violations, fault_hooks.injections, wall, error, alarms,
                      timeline.to_json(violations))


def partial_counts(engine: Engine, seconds: float) -> dict:
    """The counts of ``run_workload`` for a run that stopped early after ``seconds``."""
    reqs = list(engine.requests.values())
    return {"requests": len(reqs), "finished": sum(r.status is RequestStatus.FINISHED for r in reqs),
            "aborted": engine.stats.num_aborts, "prompt_tokens": sum(len(r.prompt_ids) for r in reqs),
            "generated_tokens": sum(len(r.output_ids) for r in reqs), "steps": engine.stats.num_steps,
            "step_seconds": seconds, "request_ids": [r.request_id for r in reqs]}


@dataclass(frozen=True)
class Verdict:
    fault: str
    injected: bool
    detected: bool | None  # None: pending, not run (see ``pending_verdict``)
    reasons: tuple[str, ...]  # every reason of the violations the injections explain
    launch_points: tuple[str, ...]
    expected: str  # e.g. "chain @ HEAD"
    expected_reasons: tuple[str, ...]
    optional_reasons: tuple[str, ...]  # may come along with the expected ones
    expected_launch_point: str
    injection_step: int | None
    slot: int | None
    first_detection: str | None  # reasons @ point of the first explained violation
    steps_to_detection: int | None
    explained: int  # violations the injections explain
    false_positives: int

    def to_json(self) -> dict:
        return {"fault": self.fault, "injected": self.injected, "detected": self.detected,
                "reasons": list(self.reasons), "launch_points": list(self.launch_points),
                "expected_reasons": list(self.expected_reasons), "optional_reasons": list(self.optional_reasons),
                "expected_launch_point": self.expected_launch_point,
                "injection_step": self.injection_step, "slot": self.slot, "first_detection": self.first_detection,
                "steps_to_detection": self.steps_to_detection, "explained_violations": self.explained,
                "false_positives": self.false_positives}


def judge(fault: type[Fault] | Fault, injections: Sequence[Injection], violations: Sequence[Violation]) -> Verdict:
    """Detected when the first violation an injection explains (in step, then launch order) is
    at the expected launch point with the expected reasons."""
    exp = fault.expected
    ordered = sorted(violations, key=lambda v: (v.step, _LAUNCH_ORDER[v.point]))
    explained = [v for v in ordered if any(i.explains(v) for i in injections)]
    first = explained[0] if explained else None
    bits = Reason(0)
    for v in explained:
        bits |= v.reasons
    inj = injections[0] if injections else None
    detected = first is not None and exp.is_met_by(first)
    return Verdict(
        fault=fault.name, injected=inj is not None, detected=detected, reasons=tuple(Reason.names(bits)),
        launch_points=tuple(p.name for p in LaunchPoint if any(v.point is p for v in explained)),
        expected=exp.describe(), expected_reasons=tuple(Reason.names(exp.reasons)),
        optional_reasons=tuple(Reason.names(exp.optional)),
        expected_launch_point=exp.point.name, injection_step=inj.step if inj else None,
        slot=inj.slot if inj else None,
        first_detection=f"{'+'.join(Reason.names(first.reasons))} @ {first.point.name}" if first else None,
        steps_to_detection=first.step - inj.step if detected and inj else None,
        explained=len(explained), false_positives=len(violations) - len(explained))


def pending_verdict(fault: type[Fault]) -> Verdict:
    """The verdict of a fault the engine cannot host yet: not run, ``detected`` None, and
    ``expected`` says what it waits for (``"pending: needs sliding-window pools"``)."""
    exp = fault.expected
    return Verdict(fault=fault.name, injected=False, detected=None, reasons=(), launch_points=(),
                   expected=f"pending: {fault.pending}", expected_reasons=tuple(Reason.names(exp.reasons)),
                   optional_reasons=tuple(Reason.names(exp.optional)), expected_launch_point=exp.point.name,
                   injection_step=None, slot=None, first_detection=None, steps_to_detection=None, explained=0,
                   false_positives=0)


@dataclass
class CampaignResult:
    clean: RunOutcome
    verdicts: list[Verdict]
    pending: list[Verdict] = field(default_factory=list)  # listed, never run, never failing

    @property
    def clean_violations(self) -> int:
        return len(self.clean.violations)

    @property
    def passed(self) -> bool:
        return self.clean_violations == 0 and all(v.detected and v.false_positives == 0 for v in self.verdicts)

    def to_json(self) -> dict:
        return {"clean_violations": self.clean_violations, "passed": self.passed,
                "faults": [v.to_json() for v in self.verdicts], "pending": [v.to_json() for v in self.pending]}


def default_faults(names: Sequence[str], seed: int, warmup_steps: int) -> list[Fault]:
    """One fault per name, acting once after ``warmup_steps`` steps (window and transfer faults
    act only on a model with sliding-window layers / in a prefill-decode split)."""
    known = FAULTS | WINDOW_FAULTS | PD_FAULTS
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown fault(s) {unknown}; choose from {sorted(known)}")
    return [known[n](seed=seed, warmup_steps=warmup_steps) for n in names]


def run_campaign(setup: RunSetup, names: Sequence[str] = tuple(FAULTS), *, seed: int = 0, warmup_steps: int = 24,
                 progress: Callable[[str], Progress | None] | None = None,
                 pending: Sequence[str] = tuple(PENDING_FAULTS)) -> CampaignResult:
    """The clean run, then one run per fault of ``names`` on the same setup; the faults of
    ``pending`` (names in ``PENDING_FAULTS``) are listed in ``CampaignResult.pending``.
    ``progress(label)`` may return a per-run progress callback."""
    unknown = [n for n in pending if n not in PENDING_FAULTS]
    if unknown:
        raise ValueError(f"unknown pending fault(s) {unknown}; choose from {sorted(PENDING_FAULTS)}")
    bar = progress or (lambda label: None)
    clean = run_once(setup, (), bar("clean"))
    verdicts = []
    for fault in default_faults(names, seed, warmup_steps):
        out = run_once(setup, [fault], bar(fault.name))
        verdicts.append(judge(fault, out.injections, out.violations))
    return CampaignResult(clean, verdicts, [pending_verdict(PENDING_FAULTS[n]) for n in pending])
