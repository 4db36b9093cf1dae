"""What the host-tier faults share: which host rows the next load-backs will copy, and an
injection that waits on the host until one of its damaged rows is loaded back.

A host-tier fault acts after TAIL of step k on rows of a host-resident prefix-cache node that a
waiting request will load back when it is admitted (front of the queue first), so the load-back
follows within a few steps. ``Injection.slot`` is -1 while the damage waits on the host and
becomes the device slot the first damaged row lands in; ``load_step[inj]`` is the step of that
load-back, and ``waiting[inj]`` holds the damaged rows still on the host until then. When every
damaged row left the host tier without a load-back (dropped, revived by a request that
recomputed the same tokens, or overwritten by another offload), nothing can ever read the
damage: the injection is discarded and the fault acts again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from kvcanary.faults.base import Injection, RequestFault, log
from kvcanary.runtime.batch import ForwardBatch

if TYPE_CHECKING:
    from kvcanary.engine.engine import Engine
    from kvcanary.engine.radix import RadixNode


def held_host_rows(engine: Engine) -> set[int]:
    """Every host row a host-resident prefix-cache node holds."""
    if engine.tree is None:
        return set()
    return {r for n in engine.tree.nodes() if n.is_on_host for r in n.host_rows.tolist()}


def rows_to_load(engine: Engine, request_id: int | None = None) -> list[tuple[RadixNode, list[int]]]:
    """(host node, rows of it) that the waiting requests (or only ``request_id``) will load back
    when admitted, front of the queue first; the same walk as the prefix-cache match, without
    its side effects."""
    tree = engine.tree
    if tree is None or engine.host_tier is None:
        return []
    ps, out, seen = tree.page_size, [], set()
    for req in engine.scheduler.waiting:
        if request_id not in (None, req.request_id):
            continue
        tokens = req.token_ids
        limit = (len(tokens) - 1) // ps * ps
        node, i = tree.root, 0
        while i + ps <= limit:
            child = node.children.get(tuple(tokens[i : i + ps]))
            if child is None:
                break
            n = 0
            while n < min(len(child.key), limit - i) and child.key[n] == tokens[i + n]:
                n += 1
            n -= n % ps
            if child.is_on_host and id(child) not in seen:
                seen.add(id(child))
                out.append((child, child.host_rows[:n].tolist()))
            if n < len(child.key):
                break
            node, i = child, i + n
    return out


class HostRowFault(RequestFault):
    """Base of the host-tier faults: subclasses implement ``damage(step, targets)``.
    ``request_id``: damage what this waiting request will load back (None: the front-most
    waiting request that will load something)."""

    def __init__(self, **gate):
        super().__init__(**gate)
        self.load_step: dict[Injection, int] = {}
        self.waiting: dict[Injection, set[int]] = {}  # injection -> its damaged rows still on the host

    def damage(self, step: int, targets: list[tuple[RadixNode, list[int]]]) -> None:
        """Damage host rows; ``targets`` is ``rows_to_load`` (non-empty). Call ``record_rows``."""
        raise NotImplementedError

    def record_rows(self, step: int, detail: str, damaged: Iterable[int], affected: Iterable[int]) -> Injection:
        """Record an injection whose ``damaged`` host rows wait for a load-back; violations of the
        slots that ``affected`` host rows are loaded into are its own."""
        inj = Injection(self.name, step, -1, detail, set(), set(affected))
        self.injections.append(inj)
        self.waiting[inj] = set(damaged)
        log.warning("fault %s: step=%d slot=-1 %s", self.name, step, detail)
        return inj

    def before_forward(self, batch: ForwardBatch, step: int) -> None:
        self._discard_unreachable(step)

    def after_forward(self, batch: ForwardBatch, step: int) -> None:
        self._discard_unreachable(step)
        if not self.is_armed(step):
            return
        targets = [(n, rows) for n, rows in rows_to_load(self.engine, self.request_id) if rows]
        if not targets:
            self.skip(step, "no target waiting request will load a host-resident prefix back")
            return
        self.damage(step, targets)

    def on_offload(self, device_slots: torch.Tensor, host_rows: torch.Tensor) -> None:
        written = set(host_rows.tolist())
        for inj in self.injections:  # another node's K/V replaced whatever these rows held
            inj.affected_host_rows -= written
            self.waiting.get(inj, set()).difference_update(written)
        super().on_offload(device_slots, host_rows)  # unless it comes from a damaged slot
        self._discard_unreachable(self.engine.step_index)

    def on_load(self, host_rows: torch.Tensor, device_slots: torch.Tensor) -> None:
        super().on_load(host_rows, device_slots)
        landed = dict(zip(host_rows.tolist(), device_slots.tolist(), strict=True))
        for inj, rows in list(self.waiting.items()):
            hit = sorted(rows & landed.keys())
            if hit:
                inj.slot = landed[hit[0]]
                self.load_step[inj] = self.engine.step_index
                del self.waiting[inj]
                log.warning("fault %s: step=%d host row %d loaded back into slot %d (injected at step %d)",
                            self.name, self.engine.step_index, hit[0], inj.slot, inj.step)

    def _discard_unreachable(self, step: int) -> None:
        if not self.waiting:
            return
        held = held_host_rows(self.engine)
        for inj, rows in list(self.waiting.items()):
            if rows & held:
                continue
            del self.waiting[inj]
            self.injections.remove(inj)
            log.warning("fault %s: step=%d host rows of the step-%d injection left the host tier without a "
                        "load-back: damage discarded, fault re-armed", self.name, step, inj.step)
