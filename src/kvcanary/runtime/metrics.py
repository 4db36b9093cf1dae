"""Prometheus metrics of one or more canaries, read from their host totals at scrape time.

    registry = CollectorRegistry()              # or the engine's own registry
    registry.register(CanaryCollector([canary], lock=engine_lock))

| metric                                   | type    | from                                            |
|------------------------------------------|---------|-------------------------------------------------|
| kvcanary_violations_total                | counter | decoded violations by reason, launch_point, pool|
|                                          |         | (a violation with two reasons counts in both)   |
| kvcanary_incidents_total                 | counter | incidents (first detection of a damaged slot and|
|                                          |         | reason, see runtime.incidents) by the same labels|
| kvcanary_violation_rows_dropped_total    | counter | rows lost to a full ring (counted, not decoded) |
| kvcanary_verified_slots_total            | counter | slot checks at HEAD, TAIL and SWEEP             |
| kvcanary_stamped_slots_total             | counter | slots stamped at HEAD                           |
| kvcanary_sweeps_total                    | counter | sweep launches                                  |
| kvcanary_verify_skipped_total            | counter | forwards whose verify was skipped (plan overflow)|
| kvcanary_recomputed_requests_total       | counter | requests handed back for re-prefill             |
| kvcanary_quarantined_slots_total         | counter | damaged slots the engine took out of its prefix |
|                                          |         | cache and host tier (whole pages)               |
| kvcanary_watchdog_alarms_total           | counter | launch points found silent                      |
| kvcanary_steps_total                     | counter | steps the canary reported on                    |
| kvcanary_seconds_total                   | counter | host wall time inside the canary                |

Every value is monotonic, so no gauge is needed. The device counters are those of the last
snapshot the reporter read (one step late on CUDA). The labelled violation series exist from the
first scrape at 0, for every reason and launch point of each canary's pool, so ``rate()`` and
``increase()`` see the first violation.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import nullcontext

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.runtime.canary import Canary

VIOLATION_LABELS = ("reason", "launch_point", "pool")


class CanaryCollector(Collector):
    """Collects the metrics of ``canaries`` (one per KV pool). ``lock``: held while reading the
    totals (pass the lock the engine holds while it steps, so a scrape never reads a step half
    accounted); None reads without one."""

    def __init__(self, canaries: Sequence[Canary], lock: threading.Lock | threading.RLock | None = None):
        if not canaries or not all(isinstance(c, Canary) for c in canaries):
            raise TypeError(f"canaries must be a non-empty sequence of Canary, got {canaries!r}")
        self.canaries = list(canaries)
        self.lock = lock

    def describe(self) -> Iterator[Metric]:
        """The metric families without reading any canary (registration checks names with it)."""
        yield from self._families({}, {k: 0 for k in _SCALARS})

    def collect(self) -> Iterator[Metric]:
        with self.lock if self.lock is not None else nullcontext():
            labelled = {(r.name.lower(), p.name, c.pool.name): 0 for c in self.canaries for r in Reason
                        for p in LaunchPoint}
            incidents = dict(labelled)
            scalars = dict.fromkeys(_SCALARS, 0)
            for c in self.canaries:
                t, counters = c.totals, c.counters()
                for key, n in list(t.by_label.items()):
                    labelled[key] = labelled.get(key, 0) + n
                for key, n in list(c.incidents.by_label.items()):
                    incidents[key] = incidents.get(key, 0) + n
                scalars["violation_rows_dropped"] += counters["dropped"]
                scalars["verified_slots"] += sum(counters[p.name]["checked"] for p in LaunchPoint)
                scalars["stamped_slots"] += counters["HEAD"]["stamped"]
                scalars["sweeps"] += t.sweeps
                scalars["verify_skipped"] += counters["plan_overflows"]
                scalars["recomputed_requests"] += t.recomputed_requests
                scalars["quarantined_slots"] += t.quarantined_slots
                scalars["watchdog_alarms"] += t.watchdog_alarms
                scalars["steps"] += t.steps
                scalars["seconds"] += t.seconds
        yield from self._families(labelled, scalars, incidents)

    @staticmethod
    def _families(labelled: dict, scalars: dict, incidents: dict | None = None) -> Iterator[Metric]:
        fam = CounterMetricFamily("kvcanary_violations", "KV-cache violations reported by the canary, by fail "
                                  "reason, launch point and pool.", labels=VIOLATION_LABELS)
        for key in sorted(labelled):
            fam.add_metric(list(key), labelled[key])
        yield fam
        fam = CounterMetricFamily("kvcanary_incidents", "KV-cache incidents: first detections of a damaged slot "
                                  "and reason (re-detections until the slot is rewritten or freed count as "
                                  "violations only), by reason, launch point of the first detection and pool.",
                                  labels=VIOLATION_LABELS)
        for key in sorted(incidents or {}):
            fam.add_metric(list(key), incidents[key])
        yield fam
        for name, help_text in _SCALARS.items():
            yield CounterMetricFamily(f"kvcanary_{name}", help_text, value=scalars[name])


_SCALARS = {
    "violation_rows_dropped": "Violation rows lost to a full ring (counted on the device, never decoded).",
    "verified_slots": "Slot checks at HEAD, TAIL and SWEEP.",
    "stamped_slots": "Slots stamped at HEAD (one per token written).",
    "sweeps": "Sweep launches over idle prefix-cache slots.",
    "verify_skipped": "Forwards whose verify was skipped because the verify plan overflowed.",
    "recomputed_requests": "Requests handed back to the engine for re-prefill (recompute policy).",
    "quarantined_slots": "Damaged slots taken out of the prefix cache and the host tier (quarantine, every policy).",
    "watchdog_alarms": "Watchdog alarms: a launch point stopped running.",
    "steps": "Steps the canary reported on.",
    "seconds": "Host wall time spent inside the canary, in seconds.",
}
