"""The typed report of a run, built from its canaries and merged across pools, sides, ranks and
attachments; ``RunReport.to_json()`` is the JSON of ``kv-canary run --report``.

| merge over   | how                                                                           |
|--------------|-------------------------------------------------------------------------------|
| pools        | ``CanaryCounts.of(canaries)``: counts summed; sweeps and the breakdowns by    |
|              | reason / launch point counted once (one sweep covers every pool; the pools    |
|              | of one engine share their breakdown)                                          |
| sides        | ``CanaryCounts.merge``: summed (the sides step one after the other)           |
| attachments  | ``CanaryCounts.merge``: summed                                                |
| ranks        | ``CanaryCounts.merge(parallel=True)``: summed, seconds the largest            |

Incidents (``runtime.incidents.incidents_report`` keys) merge over sides and ranks with
``merge_incidents``: counts summed, the first incidents tagged with their side or rank.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcanary.core.record import LaunchPoint
from kvcanary.runs.driver import RunCounts
from kvcanary.runtime.canary import Canary
from kvcanary.runtime.reporting import Violation

FIRST_VIOLATIONS = 20  # violations the report carries in full
FIRST_INCIDENTS = 20  # incidents the report carries in full


def _add_nested(a: dict, b: dict) -> dict:
    return {k: _add_nested(v, b.get(k, {})) if isinstance(v, dict) else v + b.get(k, 0) for k, v in a.items()}


@dataclass
class CanaryCounts:
    """What one or more canaries reported. ``violations``: rows the rings counted (those a full
    ring dropped included), at least ``violations_decoded``; ``violations_logged``: those the
    canaries decoded and logged; ``device``: launches, checked and stamped slots by launch point."""

    violations: int = 0
    violations_decoded: int = 0
    violations_logged: int = 0
    by_reason: Counter = field(default_factory=Counter)
    by_launch_point: Counter = field(default_factory=Counter)
    protected_slots: int = 0  # slots stamped at HEAD
    verified_slots: int = 0  # slot checks at HEAD, TAIL and SWEEP
    sweeps: int = 0
    forwards: int = 0
    steps: int = 0
    recomputed_requests: int = 0
    quarantined_slots: int = 0  # damaged slots taken out of the prefix cache and host tier
    watchdog_alarms: int = 0  # alarms reported
    watchdog_alarms_logged: int = 0
    seconds: float = 0.0  # host wall time inside the canary (the rank agreement's included)
    agreement_seconds: float = 0.0
    device: dict = field(default_factory=dict)

    @classmethod
    def of(cls, canaries: Sequence[Canary], violations: Sequence[Violation], alarms: Sequence) -> CanaryCounts:
        """The counts of one engine's canaries (one per pool) and what they reported."""
        device: dict = {}
        for c in canaries:
            device = _add_nested(c.counters(), device) if device else c.counters()
        totals = [c.totals for c in canaries]
        shared = {id(t.by_reason): t for t in totals}.values()  # pools of one engine share the breakdown
        return cls(
            violations=max(device.get("ring_total", 0), len(violations)), violations_decoded=len(violations),
            violations_logged=sum(t.violations for t in totals),
            by_reason=sum((Counter(t.by_reason) for t in shared), Counter()),
            by_launch_point=sum((Counter(t.by_launch_point) for t in shared), Counter()),
            protected_slots=device["HEAD"]["stamped"] if device else 0,
            verified_slots=sum(device[p.name]["checked"] for p in LaunchPoint) if device else 0,
            sweeps=max((t.sweeps for t in totals), default=0), forwards=max((t.forwards for t in totals), default=0),
            steps=max((t.steps for t in totals), default=0),
            recomputed_requests=sum(t.recomputed_requests for t in totals),
            quarantined_slots=sum(t.quarantined_slots for t in totals), watchdog_alarms=len(alarms),
            watchdog_alarms_logged=sum(t.watchdog_alarms for t in totals), seconds=sum(t.seconds for t in totals),
            device=device)

    def with_divergences(self, num: int, agreement_seconds: float) -> CanaryCounts:
        """These counts with a rank agreement's: its divergences are violations (``rank_divergence``)."""
        by_reason = self.by_reason + Counter({"rank_divergence": num})
        return dataclasses.replace(self, violations=self.violations + num, by_reason=by_reason,
                                   seconds=self.seconds + agreement_seconds, agreement_seconds=agreement_seconds)

    @classmethod
    def merge(cls, parts: Sequence[CanaryCounts], parallel: bool = False) -> CanaryCounts:
        """Sum of ``parts`` (sides, attachments, ranks); with ``parallel`` (ranks) the seconds are
        the largest part's."""
        out = cls()
        for p in parts:
            for f in dataclasses.fields(cls):
                a, b = getattr(out, f.name), getattr(p, f.name)
                if f.name == "device":
                    value = _add_nested(b, a) if a else dict(b)
                elif parallel and f.name.endswith("seconds"):
                    value = max(a, b)
                else:
                    value = a + b
                setattr(out, f.name, value)
        return out

    def to_json(self) -> dict:
        """The report's ``canary`` section."""
        return {"forwards": self.forwards, "steps": self.steps, "sweeps": self.sweeps,
                "violations": self.violations_logged, "recomputed_requests": self.recomputed_requests,
                "quarantined_slots": self.quarantined_slots,
                "watchdog_alarms": self.watchdog_alarms_logged, "seconds": self.seconds, "counters": self.device}


@dataclass
class RankSection:
    """One rank's part of a tensor-parallel run."""

    rank: int
    world: int
    rank_divergences: list[dict]
    recoveries: list[dict]
    outputs: list[list[int]] | None = None


@dataclass
class RunReport:
    """One run's report. ``sides``: the prefill and decode engines' own reports on a split;
    ``ranks``: each rank's on a tensor-parallel run; ``about``: what names the engine when it is
    not the reference engine (``engine_name``, ``transformers_version``)."""

    counts: RunCounts
    canary: CanaryCounts
    engine: dict[str, int]
    config: dict
    wall_seconds: float = 0.0
    stopped: str | None = None
    injections: list[dict] = field(default_factory=list)
    first_violations: list[dict] = field(default_factory=list)
    timeline: dict | None = None
    window_pool: dict | None = None
    incidents: dict = field(default_factory=dict)  # ``runtime.incidents.incidents_report`` keys
    sides: dict[str, RunReport] = field(default_factory=dict)
    transfer: dict | None = None
    rank: RankSection | None = None
    ranks: list[RunReport] = field(default_factory=list)
    about: dict = field(default_factory=dict)

    @property
    def is_clean(self) -> bool:
        """No violation, no watchdog alarm, not stopped early."""
        return not (self.canary.violations or self.canary.watchdog_alarms or self.stopped)

    @property
    def canary_time_share(self) -> float:
        seconds = self.counts.step_seconds
        if self.ranks:
            return max(r.canary_time_share for r in self.ranks)
        return self.canary.seconds / seconds if seconds > 0 else 0.0

    def to_json(self) -> dict:
        c = self.canary
        out = {
            **self.about, **self.counts.to_json(),
            "violations": c.violations, "violations_decoded": c.violations_decoded,
            "by_reason": dict(sorted(c.by_reason.items())),
            "by_launch_point": {p.name: c.by_launch_point.get(p.name, 0) for p in LaunchPoint},
            "canary_time_share": self.canary_time_share, "canary_seconds": c.seconds,
            "wall_seconds": self.wall_seconds, "protected_slots": c.protected_slots,
            "verified_slots": c.verified_slots, "sweeps": c.sweeps, "watchdog_alarms": c.watchdog_alarms,
            "stopped": self.stopped, "engine": self.engine, "canary": c.to_json(), "injections": self.injections,
            "config": self.config, "first_violations": self.first_violations, "timeline": self.timeline,
            "window_pool": self.window_pool, **self.incidents,
        }
        if self.sides:
            out |= {name: side.to_json() for name, side in self.sides.items()} | {"transfer": self.transfer}
        if self.rank is not None or self.ranks:
            out["agreement_seconds"] = c.agreement_seconds
        if self.rank is not None:
            out |= {k: v for k, v in dataclasses.asdict(self.rank).items() if k != "outputs" or v is not None}
        if self.ranks:
            out |= {"world": len(self.ranks), "ranks": [r.to_json() for r in self.ranks]}
        return out


def injections_json(injections: Sequence, **extra) -> list[dict]:
    return [{**extra, "fault": i.fault, "step": i.step, "slot": i.slot, "detail": i.detail} for i in injections]


def first_violations(violations: Sequence[Violation]) -> list[dict]:
    return [v.to_json() for v in violations[:FIRST_VIOLATIONS]]


def merge_incidents(parts: Sequence[tuple[dict, dict]]) -> dict:
    """The incident keys over several engines: ``parts`` holds (tag, incident keys) per engine,
    e.g. ({"side": "decode"}, ...) or ({"rank": 1}, ...); totals summed, by reason and by label
    added up, the first incidents (by first step) tagged with their part's ``tag``."""
    totals = Counter()
    by_reason, by_label = Counter(), Counter()
    for _, part in parts:
        totals.update({k: part.get(k, 0) for k in ("incidents", "incidents_open", "redetections")})
        by_reason.update(part.get("incidents_by_reason", {}))
        for label in part.get("incidents_by_label", []):
            by_label[label["reason"], label["launch_point"], label["pool"]] += label["incidents"]
    first = sorted(({**tag, **i} for tag, part in parts for i in part.get("first_incidents", [])),
                   key=lambda i: i["first_step"])
    return {"incidents": totals["incidents"], "incidents_open": totals["incidents_open"],
            "redetections": totals["redetections"], "incidents_by_reason": dict(sorted(by_reason.items())),
            "incidents_by_label": [{"reason": r, "launch_point": p, "pool": pool, "incidents": n}
                                   for (r, p, pool), n in sorted(by_label.items())],
            "first_incidents": first[:FIRST_INCIDENTS]}


def merge_ranks(ranks: Sequence[RunReport]) -> RunReport:
    """One report over the ranks: rank 0's workload counts and engine stats, the canaries' counts
    summed (seconds the largest), the first violations and injections tagged with their rank,
    ``ranks`` the per-rank reports (without their outputs)."""
    first = ranks[0]
    decode = dataclasses.replace(first.counts.decode, seconds=max(r.counts.decode.seconds for r in ranks))
    return RunReport(
        counts=dataclasses.replace(first.counts, decode=decode),
        canary=CanaryCounts.merge([r.canary for r in ranks], parallel=True), engine=first.engine,
        config={**first.config, "tp": len(ranks)}, wall_seconds=max(r.wall_seconds for r in ranks),
        stopped=next((r.stopped for r in ranks if r.stopped), None),
        injections=[{"rank": r.rank.rank, **i} for r in ranks for i in r.injections],
        first_violations=[{"rank": r.rank.rank, **v} for r in ranks for v in r.first_violations][:FIRST_VIOLATIONS],
        timeline=first.timeline, window_pool=first.window_pool,
        incidents=merge_incidents([({"rank": r.rank.rank}, r.incidents) for r in ranks]),
        ranks=[dataclasses.replace(r, rank=dataclasses.replace(r.rank, outputs=None)) for r in ranks])
