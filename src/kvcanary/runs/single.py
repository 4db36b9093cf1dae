"""``kv-canary run``: the workload through one reference engine with its canary (and faults, if
any), and the run's report.

``run_once(setup, faults)`` builds a fresh engine and canary, drives the workload
(``runs.driver``) and collects every violation; ``report(setup, outcome)`` is its ``RunReport``.
A ``CanaryViolation`` or ``WatchdogTimeout`` (raise and recompute policies) stops the run; it is
kept in ``error``. Fault code is imported only when faults are given, so a clean run loads none.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvcanary.core.record import Reason
from kvcanary.engine.canary_hooks import CanaryHooks
from kvcanary.engine.engine import Engine
from kvcanary.engine.hooks import EngineHooks
from kvcanary.errors import CanaryViolation
from kvcanary.runs.driver import Driver, Progress, RunCounts
from kvcanary.runs.report import CanaryCounts, RunReport, first_violations, injections_json
from kvcanary.runs.setup import RunSetup
from kvcanary.runtime.canary import WatchdogTimeout
from kvcanary.runtime.incidents import incidents_report
from kvcanary.runtime.reporting import Violation

if TYPE_CHECKING:
    from kvcanary.faults.base import Fault, Injection

STOPPING = (CanaryViolation, WatchdogTimeout)  # what ends a run early, kept as its error

EngineFactory = Callable[[EngineHooks], Engine]


@dataclass
class Instrumented:
    """An engine with its canary hooks and, when faults act on it, the fault hooks around them."""

    engine: Engine
    hooks: CanaryHooks
    fault_hooks: EngineHooks | None = None

    @property
    def injections(self) -> list[Injection]:
        return self.fault_hooks.injections if self.fault_hooks is not None else []

    def collect(self, final: Sequence[Violation] = ()) -> list[Violation]:
        """Every violation the canary hooks reported, then ``final`` (a flush's, or those of the
        step that stopped the run)."""
        return [v for r in self.hooks.reports for v in r.violations] + list(final)

    def alarms(self, final: Sequence = ()) -> list:
        return [a for r in self.hooks.reports for a in r.alarms] + list(final)


def instrument(factory: EngineFactory, hooks: CanaryHooks, faults: Sequence[Fault] = ()) -> Instrumented:
    """Build an engine with ``factory(engine_hooks)`` whose canary (``hooks``) runs inside
    ``faults``' hooks, and attach both."""
    fault_hooks = None
    if faults:
        from kvcanary.faults.hooks import FaultHooks  # fault code only for a run with faults

        fault_hooks = FaultHooks(hooks, faults)
    engine = factory(fault_hooks or hooks)
    hooks.attach(engine)
    if fault_hooks is not None:
        fault_hooks.attach(engine)
    return Instrumented(engine, hooks, fault_hooks)


def engine_factory(setup: RunSetup) -> EngineFactory:
    return lambda hooks: Engine(setup.model, setup.engine, hooks)


@dataclass
class RunOutcome:
    engine: Engine
    hooks: CanaryHooks
    counts: RunCounts
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

    def observe(self, _result=None) -> None:
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


def run_once(setup: RunSetup, faults: Sequence[Fault] = (), progress: Progress | None = None,
             stopping: tuple[type[BaseException], ...] = STOPPING) -> RunOutcome:
    """A fresh engine with the canary (and ``faults``) through the workload; ``stopping``: the
    exceptions that end the run early, kept in ``error`` (their violations in ``violations``)."""
    built = instrument(engine_factory(setup), CanaryHooks(setup.canary), faults)
    engine, hooks = built.engine, built.hooks
    driver, timeline = Driver(engine, setup.workload), StepTimeline(engine, hooks)
    error, final, final_alarms, t0 = None, [], [], time.perf_counter()
    try:
        driver.run(progress, timeline.observe)
        report = hooks.flush(engine.step_index)  # both pools
        final, final_alarms = report.violations, report.alarms
    except stopping as e:
        error = f"{type(e).__name__}: {e}" if isinstance(e, AssertionError) else str(e)
        final = getattr(e, "violations", [])
    violations = built.collect(final)
    return RunOutcome(engine, hooks, driver.counts(), violations, built.injections, time.perf_counter() - t0, error,
                      built.alarms(final_alarms), timeline.to_json(violations))


def canaries(hooks: CanaryHooks) -> list:
    """The canaries of one engine: the full pool's, and the sliding-window pool's if any."""
    return [c for c in (hooks.canary, hooks.window_canary) if c is not None]


def config_json(setup: RunSetup, **extra) -> dict:
    c = setup.canary
    return {"policy": c.policy.value, "real_kv": c.real_kv.name.lower(), "sweep_interval": c.sweep_interval,
            "sweep_budget": c.sweep_budget_bytes, "truth": c.truth, "device": setup.engine.device,
            "model": {f.name: getattr(setup.model, f.name) for f in dataclasses.fields(setup.model)
                      if f.name != "dtype"},
            "engine": {k: getattr(setup.engine, k) for k in ("num_slots", "max_ctx", "chunk_size", "max_running",
                                                             "host_tier_slots")}, **extra}


def report(setup: RunSetup, out: RunOutcome) -> RunReport:
    """The report of one engine's run: workload counts, violations, canary and engine counters."""
    return RunReport(
        counts=out.counts, canary=CanaryCounts.of(canaries(out.hooks), out.violations, out.alarms),
        engine=out.engine.stats.as_dict(), config=config_json(setup), wall_seconds=out.wall_seconds,
        stopped=out.error, injections=injections_json(out.injections),
        first_violations=first_violations(out.violations), timeline=out.timeline,
        window_pool=out.hooks.window_report(), incidents=incidents_report(canaries(out.hooks)))


def run_single(setup: RunSetup, faults: Sequence[Fault] = (), progress: Progress | None = None) -> RunReport:
    """``kv-canary run``: one reference engine through the workload; its report."""
    return report(setup, run_once(setup, faults, progress))
