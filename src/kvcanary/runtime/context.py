"""What the parts of one Canary share: its config, device state, launch tags, K/V sources, host
totals, the incidents it tracks and the step being recorded (``StepMeta``, replaced at every
``end_step``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvcanary.config import CanaryConfig
from kvcanary.core.record import LaunchPoint
from kvcanary.ops.sources import SourceSet
from kvcanary.ops.state import DeviceState
from kvcanary.runtime.incidents import IncidentTracker
from kvcanary.runtime.reporting import StepMeta


@dataclass
class CanaryTotals:
    """Host-side running totals (read from the device one step late)."""

    steps: int = 0
    forwards: int = 0
    sweeps: int = 0
    violations: int = 0
    by_reason: Counter = field(default_factory=Counter)
    by_launch_point: Counter = field(default_factory=Counter)
    by_label: Counter = field(default_factory=Counter)  # (reason, launch point, pool) -> count, for metrics
    recomputed_requests: int = 0
    quarantined_slots: int = 0  # damaged slots the engine took out of its cache (``Canary.slots_quarantined``)
    watchdog_alarms: int = 0
    device_errors: int = 0  # steps whose kernels raised a device error flag
    seconds: float = 0.0


@dataclass(eq=False)
class CanaryContext:
    """One canary's shared parts. ``tags``: each launch point's launch tag for this pool (looked
    up at every launch); ``window`` > 0: a sliding-window pool, addressed through
    ``ForwardBatch.slot_lut``; ``step``: what the current step's launches read, for the report."""

    config: CanaryConfig
    state: DeviceState
    tags: dict[LaunchPoint, int]
    window: int
    kv: SourceSet  # the K/V sources covered, their fingerprint mode and table, checked once
    totals: CanaryTotals = field(default_factory=CanaryTotals)
    incidents: IncidentTracker = field(default_factory=IncidentTracker)
    step: StepMeta = field(default_factory=lambda: StepMeta(0))
