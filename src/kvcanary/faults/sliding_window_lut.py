"""Sliding-window LUT corruption (pending: needs sliding-window pools).

Hybrid models keep a sliding-window (SWA) pool next to the full pool and translate full-pool
slots to SWA slots through a lookup table; a stale entry after a cache rebuild (sglang#25889,
#33656) makes attention read another token's window K/V. The canary verifies SWA slots through
the same table (``build_plan``'s ``lut``), so a repointed entry would fail the translated slot's
link at the HEAD that reads it: chain, with position (and verify_token with token truth) when
the wrong slot holds another position.

The reference engine has no sliding-window pools yet, so there is no table to damage: this
injector never acts (it logs why) and the campaign lists it as pending instead of running it.
"""

from __future__ import annotations

from typing import ClassVar

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.faults.base import Expectation, Fault
from kvcanary.runtime.batch import ForwardBatch


class SlidingWindowLut(Fault):
    name = "sliding_window_lut"
    expected = Expectation(LaunchPoint.HEAD, Reason.CHAIN, Reason.POSITION | Reason.VERIFY_TOKEN)
    pending: ClassVar[str] = "needs sliding-window pools"

    def before_forward(self, batch: ForwardBatch, step: int) -> None:
        if self.is_armed(step):
            self.skip(step, f"pending: {self.pending} (the engine has no sliding-window LUT)")
