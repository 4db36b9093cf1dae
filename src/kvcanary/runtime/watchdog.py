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
_SWEEP = _POINTS.index(LaunchPoint.SWEEP)


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
        # per launch point, indexed by its value (a step's check runs on plain lists, no enum hashing)
        self._last = [0] * len(_POINTS)
        self._since = [0] * len(_POINTS)
        self._seen = [p is not LaunchPoint.SWEEP for p in _POINTS]
        self._fired = [False] * len(_POINTS)

    def observe(self, stats, steps: int = 1) -> list[WatchdogAlarm]:
        """Feed a stats snapshot (int64[tags, 3], a tensor or a numpy array) covering ``steps`` more
        steps; returns new alarms."""
        col = np.asarray(stats)[:, STAT_LAUNCHES].tolist()  # one conversion; tags 4p..4p+3 are point p's
        per = len(col) // len(_POINTS)
        return self.observe_tags(col, tuple(slice(per * p, per * p + per) for p in range(len(_POINTS))), steps)

    def observe_tags(self, by_tag: list[int], points: tuple[slice, ...], steps: int = 1) -> list[WatchdogAlarm]:
        """``observe`` from each tag's launch count so far (a list in tag order) and each launch
        point's slice of it (LaunchPoint order); a point's launches are its tags' summed here, in the
        one call a step makes (between a model's launches each Python call costs µs)."""
        alarms = []
        last, since = self._last, self._since
        for i, tags in enumerate(points):
            n = sum(by_tag[tags])
            if n != last[i]:
                last[i], since[i], self._seen[i], self._fired[i] = n, 0, True, False
                continue
            since[i] += steps
            watched = self._seen[i] and (i != _SWEEP or self.periodic_sweeps)
            if watched and since[i] > self.window and not self._fired[i]:
                self._fired[i] = True
                alarms.append(WatchdogAlarm(_POINTS[i], since[i], self.window))
        return alarms
