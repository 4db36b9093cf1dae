"""The policy: what a report's violations and alarms lead to (``CanaryConfig.policy``).

``log`` keeps serving (the lines and metrics are the reporter's); ``raise`` raises
``CanaryViolation`` (``WatchdogTimeout`` for a watchdog alarm); ``recompute`` hands the engine a
``Recovery``: the requests to re-prefill and the slots to quarantine. One decision (``decide``)
serves a canary's report and the ranks' agreement; recoveries of several pools or ranks merge
into one (``merge_recoveries``); an engine applies one through a single call of its own
(``Engine.apply_recovery`` for the reference engine).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcanary.config import Policy
from kvcanary.core.record import Reason
from kvcanary.errors import CanaryViolation, KVCanaryError


class WatchdogTimeout(KVCanaryError):
    """A launch point stopped running (raised under the raise and recompute policies)."""


@dataclass(frozen=True)
class Recovery:
    """What the recompute policy hands the engine: re-prefill these requests from their token
    history, dropping tokens produced at ``since_step`` or later, and quarantine these slots.

    ``since_step`` is the first step whose forward could have read or written the damage: the
    earliest step whose checks reported it. Every slot a forward reads is verified at its HEAD
    and again at its TAIL, write targets are checked at HEAD (conflicts, bad entries) and at TAIL
    (written at all: MISSED_WRITE; then fingerprinted), so damage is reported by the first
    forward that reads or writes it, in that forward's own report. On the CPU that report is
    read before the step samples (nothing to drop); on CUDA one step late, so an engine holds
    each token back until the report of its step was read (``kvcanary.engine.delivery``). Bad
    entries name no slot to quarantine."""

    requests: tuple
    slots: tuple[int, ...]
    since_step: int


def acts(policy: Policy) -> bool:
    """Whether ``policy`` acts on what the checks found (raise, recompute); log and off do not."""
    return policy in (Policy.RAISE, Policy.RECOMPUTE)


def decide(policy: Policy, *, alarm: str | None, damage: str | None, violations: Sequence,
           recovery: Callable[[], Recovery]) -> Recovery | None:
    """The policy's decision, for a canary's report and for the ranks' agreement alike: under
    raise and recompute an ``alarm`` (the watchdog's line; None: none fired) raises
    ``WatchdogTimeout``; then ``damage`` (the line naming what was found; None: nothing) raises
    ``CanaryViolation`` carrying ``violations`` under raise, and under recompute gives
    ``recovery()``. Log and off: None."""
    if not acts(policy):
        return None
    if alarm is not None:
        raise WatchdogTimeout(alarm)
    if damage is None:
        return None
    if policy is Policy.RAISE:
        raise CanaryViolation(damage, violations)
    return recovery()


def decide_report(policy: Policy, violations: Sequence, alarms: Sequence) -> Recovery | None:
    """``decide`` on one canary's report: its ``violations`` (``Violation``) and watchdog ``alarms``."""
    alarm = "; ".join(a.line() for a in alarms) if alarms else None
    damage = f"{len(violations)} KV-cache violation(s); first: {violations[0].line()}" if violations else None
    return decide(policy, alarm=alarm, damage=damage, violations=violations,
                  recovery=lambda: recovery_of(violations))


def recovery_of(violations: Sequence) -> Recovery:
    """The requests the ``violations`` name (in order, each once), the slots to quarantine (bad
    entries name none), from the earliest step that reported them."""
    reqs = tuple(dict.fromkeys(r for v in violations for r in v.requests))
    slots = tuple(sorted({v.slot for v in violations if v.slot > 0 and not v.reasons & Reason.BAD_ENTRY}))
    return Recovery(reqs, slots, min(v.step for v in violations))


def merge_recoveries(*recoveries: Recovery | None) -> Recovery | None:
    """One recovery of several (None ones left out): every request, in order, each once; every
    slot, sorted, each once; from the earliest step. One alone is returned as it is."""
    given = [r for r in recoveries if r is not None]
    if len(given) < 2:
        return given[0] if given else None
    return Recovery(tuple(dict.fromkeys(q for r in given for q in r.requests)),
                    tuple(sorted({s for r in given for s in r.slots})), min(r.since_step for r in given))
