"""The policy: what a report's violations and alarms lead to (``CanaryConfig.policy``).

``log`` keeps serving (the lines and metrics are the reporter's); ``raise`` raises
``CanaryViolation`` (``WatchdogTimeout`` for a watchdog alarm); ``recompute`` hands the engine a
``Recovery``: the requests to re-prefill and the slots to quarantine.
"""

from __future__ import annotations

from collections.abc import Sequence
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


def decide(policy: Policy, violations: Sequence, alarms: Sequence) -> Recovery | None:
    """What ``policy`` makes of a report's ``violations`` (``Violation``) and watchdog ``alarms``:
    raises ``WatchdogTimeout`` for an alarm under raise and recompute, ``CanaryViolation`` for a
    violation under raise; under recompute the ``Recovery`` of the violations; else None."""
    if alarms and policy in (Policy.RAISE, Policy.RECOMPUTE):
        raise WatchdogTimeout("; ".join(a.line() for a in alarms))
    if not violations:
        return None
    if policy is Policy.RAISE:
        first = violations[0]
        raise CanaryViolation(f"{len(violations)} KV-cache violation(s); first: {first.line()}", violations)
    if policy is Policy.RECOMPUTE:
        reqs = tuple(dict.fromkeys(r for v in violations for r in v.requests))
        slots = tuple(sorted({v.slot for v in violations if v.slot > 0 and not v.reasons & Reason.BAD_ENTRY}))
        return Recovery(reqs, slots, min(v.step for v in violations))
    return None
