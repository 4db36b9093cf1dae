"""Watchdog: fails loudly when a launch point's launch counter stops advancing.

HEAD and TAIL must launch in every step that ran a forward; SWEEP is expected only when sweeps are
periodic and once it has launched at least once (an engine without a prefix cache never sweeps;
without periodic sweeps SWEEP launches only for landed copies, whenever they come). A point
silent for more than ``window`` steps fires once, until it launches again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvcanary.core.record import STAT_LAUNCHES, LaunchPoint

_POINTS = tuple(LaunchPoint)


@dataclass(frozen=True)
class WatchdogAlarm:
    point: LaunchPoint
    silent_steps: int
    window: int

    def line(self) -> str:
        return (f"kv_canary watchdog: point={self.point.name} silent_steps={self.silent_steps} "
                f"window={self.window} checks stopped running")


class Watchdog:
    def __init__(self, window: int, periodic_sweeps: bool = True):
        self.window, self.periodic_sweeps = window, periodic_sweeps
        self._last = {p: 0 for p in LaunchPoint}
        self._since = {p: 0 for p in LaunchPoint}
        self._seen = {LaunchPoint.HEAD: True, LaunchPoint.TAIL: True, LaunchPoint.SWEEP: False}
        self._fired = {p: False for p in LaunchPoint}

    def observe(self, stats, steps: int = 1) -> list[WatchdogAlarm]:
        """Feed a stats snapshot (int64[tags, 3], a tensor or a numpy array) covering ``steps`` more
        steps; returns new alarms."""
        col = np.asarray(stats)[:, STAT_LAUNCHES].tolist()  # one conversion; tags 4p..4p+3 are point p's
        per = len(col) // len(_POINTS)
        return self.observe_launches([sum(col[per * p: per * p + per]) for p in _POINTS], steps)

    def observe_launches(self, launches, steps: int = 1) -> list[WatchdogAlarm]:
        """``observe`` from each launch point's launch count so far (a sequence in LaunchPoint order)."""
        alarms = []
        for p in _POINTS:
            n = launches[p]
            if n != self._last[p]:
                self._last[p], self._since[p], self._seen[p], self._fired[p] = n, 0, True, False
                continue
            self._since[p] += steps
            watched = self._seen[p] and (p is not LaunchPoint.SWEEP or self.periodic_sweeps)
            if watched and self._since[p] > self.window and not self._fired[p]:
                self._fired[p] = True
                alarms.append(WatchdogAlarm(p, self._since[p], self.window))
        return alarms
