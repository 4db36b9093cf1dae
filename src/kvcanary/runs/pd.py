"""``kv-canary run --pd``: the workload through a prefill/decode split of two reference engines in
one process, and its report (both sides merged, each side's own, the transfer's).

``run_pd_once(setup, faults)`` builds a prefill engine and a decode engine (same configs, each
with its canary) and a ``KVTransfer`` between them, and drives the workload through both
(``runs.driver``). Faults act on the decode engine (``FaultHooks``) and, transfer faults, on the
transfer (``TransferHooks``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcanary.engine.canary_hooks import CanaryHooks
from kvcanary.engine.engine import Engine
from kvcanary.engine.pd import KVTransfer, TransferHooks
from kvcanary.runs.driver import Driver, Progress, RunCounts, StepCounts
from kvcanary.runs.report import CanaryCounts, RunReport, first_violations, injections_json, merge_incidents
from kvcanary.runs.setup import OptionError, RunSetup
from kvcanary.runs.single import STOPPING, canaries, config_json, engine_factory, instrument
from kvcanary.runtime.incidents import incidents_report
from kvcanary.runtime.reporting import Violation

if TYPE_CHECKING:
    from kvcanary.faults.base import Fault, Injection

ENGINE_SUMS = ("num_evicted_slots", "num_offloaded_slots", "num_loaded_slots", "num_aborts", "num_preemptions",
               "num_recomputes")


@dataclass
class Side:
    """One engine of the split and what its canary reported."""

    engine: Engine
    hooks: CanaryHooks
    violations: list[Violation]
    alarms: list


@dataclass
class PDOutcome:
    prefill: Side
    decode: Side
    transfer: KVTransfer
    counts: RunCounts
    injections: list[Injection]
    wall_seconds: float
    error: str | None = None


def check_split(setup: RunSetup) -> None:
    if setup.model.window_layers:
        raise OptionError("--pd moves full-attention pools only; use --model tiny or small", "--pd")
    if not setup.engine.enable_prefix_cache:
        raise OptionError("--pd needs the prefix cache: the decode engine receives K/V through it", "--pd")


def run_pd_once(setup: RunSetup, faults: Sequence[Fault] = (), progress: Progress | None = None) -> PDOutcome:
    """Both engines with their canaries through ``setup.workload``. A ``CanaryViolation`` or
    ``WatchdogTimeout`` stops the run (kept in ``error``, its violations on the decode side)."""
    factory = engine_factory(setup)
    prefill = instrument(factory, CanaryHooks(setup.canary))
    decode = instrument(factory, CanaryHooks(setup.canary), faults)
    on_transfer = [f for f in faults if isinstance(f, TransferHooks)]
    transfer = KVTransfer(prefill.engine, decode.engine, prefill.hooks.canary, decode.hooks.canary, hooks=on_transfer)
    for f in on_transfer:
        f.attach_transfer(transfer)
    driver, error, t0 = Driver(transfer, setup.workload), None, time.perf_counter()
    finals: dict[int, tuple[list, list]] = {}
    try:
        driver.run(progress)
        for i, side in enumerate((prefill, decode)):
            final = side.hooks.flush(side.engine.step_index)
            finals[i] = (final.violations, final.alarms)
    except STOPPING as e:
        error = str(e)
        finals[1] = (getattr(e, "violations", []), [])
    wall = time.perf_counter() - t0
    sides = []
    for i, side in enumerate((prefill, decode)):
        final_v, final_a = finals.get(i, ([], []))
        sides.append(Side(side.engine, side.hooks, side.collect(final_v), side.alarms(final_a)))
    return PDOutcome(sides[0], sides[1], transfer, driver.counts(), decode.injections, wall, error)


def _side_report(side: Side, steps: StepCounts) -> RunReport:
    counts = RunCounts(decode=steps)
    return RunReport(counts=counts, canary=CanaryCounts.of([side.hooks.canary], side.violations, side.alarms),
                     engine=side.engine.stats.as_dict(), config={}, first_violations=first_violations(side.violations),
                     incidents=incidents_report(canaries(side.hooks)))


def report(setup: RunSetup, out: PDOutcome) -> RunReport:
    """The report of ``run`` summed over both engines, plus ``prefill``, ``decode`` and ``transfer``."""
    c = out.counts
    sides = {"prefill": _side_report(out.prefill, c.prefill), "decode": _side_report(out.decode, c.decode)}
    engine = {k: sum(s.engine[k] for s in sides.values()) for k in ENGINE_SUMS}
    violations = out.prefill.violations + out.decode.violations
    return RunReport(counts=c, canary=CanaryCounts.merge([s.canary for s in sides.values()]), engine=engine,
                     config=config_json(setup, pd=True), wall_seconds=out.wall_seconds, stopped=out.error,
                     injections=injections_json(out.injections), first_violations=first_violations(violations),
                     sides=sides, transfer=dataclasses.asdict(out.transfer.stats),
                     incidents=merge_incidents([({"side": name}, s.incidents) for name, s in sides.items()]))


def run_pd(setup: RunSetup, faults: Sequence[Fault] = (), progress: Progress | None = None) -> RunReport:
    """``kv-canary run --pd``: run the split and build its report."""
    check_split(setup)
    return report(setup, run_pd_once(setup, faults, progress))
