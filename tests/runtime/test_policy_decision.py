"""The one policy decision (``runtime.policy.decide``), as the canary and the ranks' agreement
both take it, and the one merge of recovery sets."""

from __future__ import annotations

import pytest

from kvcanary.config import Policy
from kvcanary.core.record import LaunchPoint, LaunchTag, Reason
from kvcanary.errors import CanaryViolation
from kvcanary.runtime.policy import Recovery, WatchdogTimeout, acts, decide, merge_recoveries, recovery_of
from kvcanary.runtime.reporting import Violation


def _decide(policy, alarm=None, damage=None, violations=("v",)):
    calls = []
    rec = Recovery((7,), (3,), 11)
    out = decide(policy, alarm=alarm, damage=damage, violations=list(violations),
                 recovery=lambda: calls.append(1) or rec)
    return out, len(calls), rec


@pytest.mark.parametrize("policy", [Policy.LOG, Policy.OFF])
def test_log_and_off_act_on_nothing(policy):
    assert not acts(policy)
    assert _decide(policy, alarm="watchdog", damage="found")[:2] == (None, 0)


@pytest.mark.parametrize("policy", [Policy.RAISE, Policy.RECOMPUTE])
def test_an_alarm_raises_first_under_raise_and_recompute(policy):
    assert acts(policy)
    with pytest.raises(WatchdogTimeout, match="^watchdog fired$"):
        _decide(policy, alarm="watchdog fired", damage="found")


def test_raise_carries_the_violations():
    with pytest.raises(CanaryViolation, match="^2 found$") as e:
        _decide(Policy.RAISE, damage="2 found", violations=("a", "b"))
    assert e.value.violations == ["a", "b"]


def test_recompute_asks_for_the_recovery_only_when_something_was_found():
    out, calls, rec = _decide(Policy.RECOMPUTE, damage="found")
    assert out is rec and calls == 1
    assert _decide(Policy.RECOMPUTE)[:2] == (None, 0)


def test_one_merge_of_recovery_sets():
    a = Recovery((5, 2), (9, 4), 12)
    b = Recovery((2, 8), (4, 1), 10)
    assert merge_recoveries() is None and merge_recoveries(None, None) is None
    assert merge_recoveries(None, a) is a  # one alone, as it is
    assert merge_recoveries(a, None, b) == Recovery((5, 2, 8), (1, 4, 9), 10)
    assert merge_recoveries(b, a) == Recovery((2, 8, 5), (1, 4, 9), 10)


def test_a_recovery_quarantines_only_real_slots_its_violations_found_damaged():
    """Every request the violations name, in order, each once; the slots to quarantine: those
    > 0 that are not BAD_ENTRY targets (a bad entry names a page-table value, not a damaged
    slot; slot 0 is the reserved padding slot, never quarantined), sorted; the earliest step."""
    def v(step, slot, reasons, requests):
        return Violation(step, LaunchTag(LaunchPoint.HEAD), reasons, slot, 3, 1, 1, 0, 0,
                         tuple((r, 3) for r in requests))

    found = [v(9, 7, Reason.CHAIN, (4,)), v(8, 0, Reason.WRITE_TOKEN, (2, 4)), v(9, 5, Reason.BAD_ENTRY, (6,)),
             v(10, -1, Reason.BAD_ENTRY | Reason.VERIFY_TOKEN, (2,)), v(9, 3, Reason.FINGERPRINT, ())]
    assert recovery_of(found) == Recovery((4, 2, 6), (3, 7), 8)
