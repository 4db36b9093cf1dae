"""Judge what the canary reported on a run with faults (or a zoo switch): ``judge`` splits the
violations into those an injection explains and false positives, and checks the first explained
one against the fault's expectation. ``select_faults`` builds the faults of a run by name and
refuses one that cannot act in the run's mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.errors import ConfigError
from kvcanary.faults import FAULTS, PD_FAULTS, WINDOW_FAULTS
from kvcanary.faults.base import Fault, Injection
from kvcanary.runtime.reporting import Violation

_LAUNCH_ORDER = {LaunchPoint.SWEEP: 0, LaunchPoint.HEAD: 1, LaunchPoint.TAIL: 2}  # within one step


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


def judge(fault: type[Fault] | Fault, injections: Sequence[Injection], violations: Sequence[Violation],
          elsewhere: Sequence[Violation] = ()) -> Verdict:
    """Detected when the first violation an injection explains (in step, then launch order) is
    at the expected launch point with the expected reasons. ``elsewhere``: violations of engines
    the fault does not act on (the prefill side of a split), each a false positive."""
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
        explained=len(explained), false_positives=len(violations) - len(explained) + len(elsewhere))


def pending_verdict(fault: type[Fault]) -> Verdict:
    """The verdict of a fault the engine cannot host yet: not run, ``detected`` None, and
    ``expected`` says what it waits for (``"pending: needs sliding-window pools"``)."""
    exp = fault.expected
    return Verdict(fault=fault.name, injected=False, detected=None, reasons=(), launch_points=(),
                   expected=f"pending: {fault.pending}", expected_reasons=tuple(Reason.names(exp.reasons)),
                   optional_reasons=tuple(Reason.names(exp.optional)), expected_launch_point=exp.point.name,
                   injection_step=None, slot=None, first_detection=None, steps_to_detection=None, explained=0,
                   false_positives=0)




class FaultModeError(ConfigError):
    """A fault that cannot act in the run's mode; ``needs`` names the option it needs."""

    def __init__(self, message: str, needs: str):
        super().__init__(message)
        self.needs = needs


def select_faults(names: Sequence[str], seed: int, warmup_steps: int, *, pd: bool = False,
                  window: bool = False) -> list[Fault]:
    """One fault per name, acting once after ``warmup_steps`` steps. Transfer faults need a
    prefill/decode split (``pd``), window faults a model with sliding-window layers (``window``);
    either elsewhere raises ``FaultModeError`` (it could never act), an unknown name ConfigError."""
    known = FAULTS | WINDOW_FAULTS | PD_FAULTS
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"unknown fault(s) {unknown}; choose from {sorted(known)}")
    for name in names:
        if name in PD_FAULTS and not pd:
            raise FaultModeError(f"fault {name} acts on the prefill/decode transfer; add --pd", "--pd")
        if name in WINDOW_FAULTS and not window:
            raise FaultModeError(f"fault {name} acts on the sliding-window pool; use --model hybrid-swa",
                                 "--model hybrid-swa")
    return [known[n](seed=seed, warmup_steps=warmup_steps) for n in names]
