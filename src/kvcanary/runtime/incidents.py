"""Incidents: what one piece of damage is, however often it is read.

A *violation* is one failed check of one slot at one launch point: a damaged slot read for 15
steps gives 15. An *incident* is the first violation of a damaged (slot, reason) until that slot
is rewritten (HEAD stamps it again, or records land in it by ``import_rows`` / ``load_back``) or
freed (``Canary.slots_freed``): the same slot failing for the same reason meanwhile is a
re-detection of the open incident, counted, not reported again. The keys are (slot, reason bit):
a violation whose reasons include a bit not open on its slot opens one incident carrying those
new bits (so each violation either opens one incident or is a re-detection, and one log line per
incident holds exactly); a later violation of the slot with only open bits re-detects. Violations
that name no slot (slot <= 0) are keyed by their position and requests as well.

Ordering: violations are decoded one step late on CUDA, so rewrites and frees are queued with
the step they happened at and applied before the violations of that step and later ones. Only
slots with an open incident are tracked, so without damage this costs nothing; on CUDA the test
"was an open slot rewritten" runs on the device and is read one step later (no host sync).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

import torch

from kvcanary.core.record import LaunchPoint, PoolKind, Reason
from kvcanary.runtime.reporting import INCIDENTS_RE, Violation

__all__ = ["INCIDENTS_RE", "Incident", "IncidentTracker", "incidents_report"]

HISTORY = 1024  # first incidents kept for reports and the admin route (all are counted, open ones kept)


@dataclass
class Incident:
    """One damage: the slot, the reason bits its first violation opened, how often it was
    detected since, and when and how it closed (``closed_by``: ``"rewritten"`` or ``"freed"``;
    None while open)."""

    id: int
    reasons: Reason
    first: Violation
    detections: int = 1
    last_step: int = 0
    closed_step: int | None = None
    closed_by: str | None = None

    @property
    def slot(self) -> int:
        return self.first.slot

    @property
    def point(self) -> LaunchPoint:
        return self.first.point

    @property
    def pool(self) -> PoolKind:
        return self.first.tag.pool

    @property
    def is_open(self) -> bool:
        return self.closed_by is None

    def to_json(self) -> dict:
        return {"id": self.id, "pool": self.pool.name, "slot": self.slot, "reasons": Reason.names(self.reasons),
                "launch_point": self.point.name, "first_step": self.first.step, "last_step": self.last_step,
                "detections": self.detections, "open": self.is_open, "closed_step": self.closed_step,
                "closed_by": self.closed_by, "tag": str(self.first.tag), "layer": self.first.layer,
                "sources": [{"layer": layer, "half": half.name} for layer, half in self.first.sources],
                "first_violation": self.first.to_json()}


@dataclass
class _Close:
    step: int
    how: str
    slots: set[int] | None = None  # known on the host
    candidates: list[int] | None = None  # CUDA: open slots tested on the device ...
    hit: torch.Tensor | None = None  # ... bool[len(candidates)] in pinned memory, valid once event is done
    event: object | None = None

    def resolve(self) -> set[int]:
        if self.slots is None:
            self.event.synchronize()  # recorded a step ago: already complete
            self.slots = {s for s, h in zip(self.candidates, self.hit.tolist(), strict=True) if h}
        return self.slots


def _key(v: Violation, reason: Reason) -> tuple:
    if v.slot > 0:
        return v.slot, int(reason)
    return v.slot, int(reason), v.position, v.requests


@dataclass
class IncidentTracker:
    """The incidents of one canary (one pool)."""

    open: dict[tuple, Incident] = field(default_factory=dict)
    history: list[Incident] = field(default_factory=list)  # the first HISTORY incidents
    num_incidents: int = 0
    redetections: int = 0
    closed: int = 0
    by_label: Counter = field(default_factory=Counter)  # (reason, launch point, pool) -> incidents
    _closes: deque = field(default_factory=deque)
    _summary: list = field(default_factory=lambda: [0, 0, 0])  # new incidents, re-detections, closes since the last

    @property
    def pending(self) -> bool:
        """Whether ``observe`` has closes to apply (slots rewritten or freed while incidents were open)."""
        return bool(self._closes)

    def open_incidents(self) -> list[Incident]:
        """The open incidents, oldest first."""
        return sorted({id(i): i for i in self.open.values()}.values(), key=lambda i: i.id)

    @property
    def open_slots(self) -> set[int]:
        return {k[0] for k in self.open if k[0] > 0}

    def note(self, step: int, slots: torch.Tensor, how: str) -> None:
        """``slots`` were rewritten or freed at ``step``: their open incidents close (once the
        violations of earlier steps are in). Free of cost while nothing is open."""
        candidates = sorted(self.open_slots)
        if not candidates or slots.numel() == 0:
            return
        if slots.is_cuda:
            dev = slots.device
            cand = torch.tensor(candidates, dtype=torch.int64).pin_memory().to(dev, non_blocking=True)
            hit = torch.empty(len(candidates), dtype=torch.bool, pin_memory=True)
            hit.copy_(torch.isin(cand, slots.to(torch.int64)), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._closes.append(_Close(step, how, candidates=candidates, hit=hit, event=event))
        else:
            hit = set(slots.to(torch.int64).tolist()).intersection(candidates)
            if hit:
                self._closes.append(_Close(step, how, slots=hit))

    def observe(self, violations: list[Violation], upto_step: int) -> list[tuple[Violation, list[Incident]]]:
        """Account ``violations`` (every violation of steps <= ``upto_step`` is in now). Returns
        each violation with the incidents it opened (empty for a re-detection)."""
        out = []
        for v in violations:
            self._apply_closes(v.step)
            bits = [r for r in Reason if v.reasons & r]
            new = [r for r in bits if _key(v, r) not in self.open]
            if new:
                self.num_incidents += 1
                inc = Incident(self.num_incidents, Reason(sum(new)), v, last_step=v.step)
                for r in new:
                    self.open[_key(v, r)] = inc
                    self.by_label[r.name.lower(), v.point.name, v.tag.pool.name] += 1
                if len(self.history) < HISTORY:
                    self.history.append(inc)
                self._summary[0] += 1
                out.append((v, [inc]))
                continue
            for inc in {id(i): i for i in (self.open[_key(v, r)] for r in bits)}.values():
                inc.detections += 1
                inc.last_step = v.step
            self.redetections += 1
            self._summary[1] += 1
            out.append((v, []))
        self._apply_closes(upto_step)
        return out

    def _apply_closes(self, upto_step: int) -> None:
        while self._closes and self._closes[0].step <= upto_step:
            c = self._closes.popleft()
            slots = c.resolve()
            for key in [k for k in self.open if k[0] in slots]:
                inc = self.open.pop(key)
                if inc.is_open:
                    inc.closed_step, inc.closed_by = c.step, c.how
                    self.closed += 1
                    self._summary[2] += 1

    def summary_line(self, step: int) -> str | None:
        """The periodic summary line, or None when nothing happened since the last one."""
        new, again, closed = self._summary
        if not (new or again or closed):
            return None
        self._summary = [0, 0, 0]
        return (f"kv_canary incidents: step={step} open={len(self.open_incidents())} incidents={self.num_incidents} "
                f"redetections={self.redetections} new_incidents={new} new_redetections={again} closed={closed}")


def incidents_report(canaries: list, limit: int = 20) -> dict:
    """The incident keys of a run report over one or more canaries (pools): totals, by reason,
    by launch point and pool, and the first ``limit`` incidents."""
    trackers: list[IncidentTracker] = [c.incidents for c in canaries]
    by_reason: Counter = Counter()
    by_label: Counter = Counter()
    for t in trackers:
        by_label.update(t.by_label)
        for (reason, _, _), n in t.by_label.items():
            by_reason[reason] += n
    first = sorted((i for t in trackers for i in t.history), key=lambda i: (i.first.step, i.pool, i.id))[:limit]
    return {"incidents": sum(t.num_incidents for t in trackers),
            "incidents_open": sum(len(t.open_incidents()) for t in trackers),
            "redetections": sum(t.redetections for t in trackers),
            "incidents_by_reason": dict(sorted(by_reason.items())),
            "incidents_by_label": [{"reason": r, "launch_point": p, "pool": pool, "incidents": n}
                                   for (r, p, pool), n in sorted(by_label.items())],
            "first_incidents": [i.to_json() for i in first]}
