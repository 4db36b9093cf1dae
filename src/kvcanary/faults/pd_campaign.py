"""Run the built-in workload through a prefill/decode split and judge what each side reported.

``run_pd_once(setup, faults)`` builds a prefill engine and a decode engine (same configs, each
with its canary), a ``KVTransfer`` between them, and drives the workload through both. Faults
act on the decode engine (``FaultHooks``) and on the transfer (``TransferHooks``, transfer
faults only). ``judge_pd`` judges a fault on the decode side's violations; every violation of
the prefill side counts as a false positive (the damage happens after its last check).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcanary.engine.canary_hooks import CanaryHooks
from kvcanary.engine.engine import Engine
from kvcanary.engine.pd import KVTransfer, PDCounts, run_pd_workload
from kvcanary.engine.workload import Progress
from kvcanary.errors import CanaryViolation
from kvcanary.faults import FAULTS, PD_FAULTS
from kvcanary.faults._transfer import TransferFault
from kvcanary.faults.base import Fault, Injection
from kvcanary.faults.campaign import RunSetup, Verdict, judge
from kvcanary.faults.hooks import FaultHooks, attach_faults
from kvcanary.runtime.canary import WatchdogTimeout
from kvcanary.runtime.reporting import Violation


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
    counts: PDCounts
    injections: list[Injection]
    wall_seconds: float
    error: str | None = None


def pd_faults(names: Sequence[str], seed: int, warmup_steps: int) -> list[Fault]:
    """One fault per name (``PD_FAULTS`` or ``FAULTS``: the latter act on the decode engine)."""
    known = PD_FAULTS | FAULTS
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown fault(s) {unknown}; choose from {sorted(known)}")
    return [known[n](seed=seed, warmup_steps=warmup_steps) for n in names]


def _collect(hooks: CanaryHooks, final: list[Violation]) -> list[Violation]:
    return [v for r in hooks.reports for v in r.violations] + list(final)


def run_pd_once(setup: RunSetup, faults: Sequence[Fault] = (), progress: Progress | None = None) -> PDOutcome:
    """Both engines with their canaries through ``setup.workload``. A ``CanaryViolation`` or
    ``WatchdogTimeout`` stops the run (kept in ``error``)."""
    factory = lambda h: Engine(setup.model, setup.engine, h)
    prefill, p_hooks, _ = attach_faults(factory, setup.canary, ())
    decode, d_hooks, f_hooks = attach_faults(factory, setup.canary, faults)
    transfer = KVTransfer(prefill, decode, p_hooks.canary, d_hooks.canary,
                          hooks=[f for f in faults if isinstance(f, TransferFault)])
    for f in faults:
        if isinstance(f, TransferFault):
            f.attach_transfer(transfer)
    error, t0, counts = None, time.perf_counter(), PDCounts()
    finals: dict[int, tuple[list, list]] = {}
    try:
        counts = run_pd_workload(transfer, setup.workload, progress)
        for side, engine, hooks in ((0, prefill, p_hooks), (1, decode, d_hooks)):
            final = hooks.flush(engine.step_index)
            finals[side] = (final.violations, final.alarms)
    except (CanaryViolation, WatchdogTimeout) as e:
        error = str(e)
        finals[1] = (getattr(e, "violations", []), [])
    wall = time.perf_counter() - t0
    sides = []
    for side, engine, hooks in ((0, prefill, p_hooks), (1, decode, d_hooks)):
        final_v, final_a = finals.get(side, ([], []))
        sides.append(Side(engine, hooks, _collect(hooks, final_v),
                          [a for r in hooks.reports for a in r.alarms] + list(final_a)))
    injections = f_hooks.injections if isinstance(f_hooks, FaultHooks) else []
    return PDOutcome(sides[0], sides[1], transfer, counts, injections, wall, error)


def judge_pd(fault: Fault, out: PDOutcome) -> Verdict:
    """``judge`` on the decode side; the prefill side's violations are false positives."""
    verdict = judge(fault, out.injections, out.decode.violations)
    fp = verdict.false_positives + len(out.prefill.violations)
    return Verdict(**{**verdict.__dict__, "false_positives": fp})


@dataclass
class PDCampaignResult:
    clean: PDOutcome
    verdicts: list[Verdict]

    @property
    def clean_violations(self) -> int:
        return len(self.clean.prefill.violations) + len(self.clean.decode.violations)

    @property
    def passed(self) -> bool:
        return self.clean_violations == 0 and all(v.detected and v.false_positives == 0 for v in self.verdicts)

    def to_json(self) -> dict:
        return {"clean_violations": self.clean_violations, "passed": self.passed,
                "faults": [v.to_json() for v in self.verdicts]}


def run_pd_campaign(setup: RunSetup, names: Sequence[str] = tuple(PD_FAULTS), *, seed: int = 0,
                    warmup_steps: int = 8, progress: Callable[[str], Progress | None] | None = None
                    ) -> PDCampaignResult:
    """A clean split run, then one per fault of ``names``, each judged on the decode side."""
    bar = progress or (lambda label: None)
    clean = run_pd_once(setup, (), bar("pd clean"))
    verdicts = []
    for fault in pd_faults(names, seed, warmup_steps):
        out = run_pd_once(setup, [fault], bar(f"pd {fault.name}"))
        verdicts.append(judge_pd(fault, out))
    return PDCampaignResult(clean, verdicts)
