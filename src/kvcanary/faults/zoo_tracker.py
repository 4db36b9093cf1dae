"""``ZooTracker``: follows one real-bug zoo switch (``kvcanary.engine.zoo``) through a run as if it
were a fault, so ``judge`` tells the violations the bug explains from false positives: every act
the engine logs becomes an ``Injection``, and the damage is followed through offload, load-back
and broken chain links.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvcanary.core.record import LaunchPoint, format_reasons
from kvcanary.engine.zoo import CATALOGUE, Bug, ZooEvent
from kvcanary.faults.base import Expectation, Fault, Injection
from kvcanary.runtime.reporting import Violation


@dataclass(frozen=True)
class ZooExpectation(Expectation):
    """An expectation whose first violation may also come at the launch points ``also_at``."""

    also_at: tuple[LaunchPoint, ...] = ()

    def is_met_by(self, v: Violation) -> bool:
        return any(Expectation(p, self.reasons, self.optional).is_met_by(v) for p in (self.point, *self.also_at))

    def describe(self) -> str:
        return f"{format_reasons(self.reasons)} @ {'/'.join(p.name for p in (self.point, *self.also_at))}"


@dataclass(eq=False)
class ZooInjection(Injection):
    """An act of a zoo switch; request-scoped acts also explain violations on the positions they
    got wrong (``affected_positions``: (request id, position))."""

    affected_positions: set[tuple[int, int]] = field(default_factory=set)

    def explains(self, v: Violation) -> bool:
        return super().explains(v) or (v.step >= self.step and any(o in self.affected_positions for o in v.owners))


class ZooTracker(Fault):
    """Follows one zoo switch through a run: never acts itself; every event the engine logs
    becomes an injection at the step it was seen, and the damage is followed through offload,
    load-back and broken chain links (of requests and of cached runs)."""

    def __init__(self, bug: Bug):
        super().__init__()
        info = CATALOGUE[bug]
        self.bug, self.name = bug, bug.value
        self.expected = ZooExpectation(info.point, info.reasons, info.optional, info.also_at)
        self._num_seen = 0
        self._unresolved: list[tuple[ZooInjection, ZooEvent]] = []  # positions not backed by slots yet

    def poll(self) -> None:
        """Turn new events into injections; add the slots of request positions once they exist."""
        events: list[ZooEvent] = self.engine.zoo.events
        for e in events[self._num_seen:]:
            inj = ZooInjection(e.bug.value, self.engine.step_index, e.slots[0] if e.slots else -1, e.detail,
                               {s for s in e.slots if s > 0}, set(e.host_rows))
            if e.request_id is not None:
                inj.affected_positions = {(e.request_id, p) for p in e.positions}
                self._unresolved.append((inj, e))
            self.injections.append(inj)
        self._num_seen = len(events)
        if self._unresolved:
            self._unresolved = [(inj, e) for inj, e in self._unresolved if not self._resolve(inj, e)]

    def _resolve(self, inj: ZooInjection, e: ZooEvent) -> bool:
        req = self.engine.requests.get(e.request_id)
        if req is None or not req.is_active:
            return True  # gone: nothing left to resolve
        if req.capacity <= max(e.positions):
            return False
        inj.affected_slots |= {int(req.slots[p]) for p in e.positions}
        return True

    def before_forward(self, batch, step: int) -> None:
        self.poll()

    def after_forward(self, batch, step: int) -> None:
        self.poll()

    def on_report(self, request_ids: Sequence, tables: torch.Tensor, violations: list[Violation]) -> None:
        """Damage spreads along chain links: a violation on a slot whose predecessor (in the page
        table of a request that read it, or in its prefix-cache node) is affected is explained by
        the earliest injection that affected the predecessor."""
        self.poll()
        if not self.injections:
            return
        rows, index = tables.tolist(), {rid: i for i, rid in enumerate(request_ids)}
        cached_pred = self._cached_predecessors() if any(v.point is LaunchPoint.SWEEP for v in violations) else {}
        affected = set().union(*(inj.affected_slots for inj in self.injections))
        for v in violations:
            preds = {rows[index[r]][p - 1] for r, p in v.owners if r in index and p > 0}
            if v.slot in cached_pred:
                preds.add(cached_pred[v.slot])
            if v.slot in affected or not preds & affected:
                continue
            affected.add(v.slot)
            for inj in self.injections:
                if v.step < inj.step:
                    break
                if v.slot in inj.affected_slots:
                    break
                if preds & inj.affected_slots:
                    inj.affected_slots.add(v.slot)
                    break

    def _cached_predecessors(self) -> dict[int, int]:
        """Slot -> the slot before it, for every device-resident prefix-cache node."""
        tree, pred = self.engine.tree, {}
        if tree is None:
            return pred
        for node in tree.nodes():
            if node.is_on_host:
                continue
            slots = node.slots.tolist()
            parent = node.parent
            prev = int(parent.slots[-1]) if parent is not tree.root and not parent.is_on_host else -1
            pred.update(zip(slots, [prev, *slots[:-1]], strict=True))
        return pred

    def on_offload(self, device_slots: torch.Tensor, host_rows: torch.Tensor) -> None:
        self.poll()
        super().on_offload(device_slots, host_rows)

    def on_load(self, host_rows: torch.Tensor, device_slots: torch.Tensor) -> None:
        self.poll()
        super().on_load(host_rows, device_slots)

    def on_free(self, slots: torch.Tensor) -> None:
        self.poll()
