"""Damage that travels down a request's sequence.

The chain is a prefix hash: once a request wrote a wrong token or position, or chained its
writes from a damaged record, every slot it writes after that carries a chain derived from the
damage, consistent with its own records but not with a clean copy of the same prefix. Where such
a run meets a clean one in the prefix cache (a finished request's slots join the tree under, or
above, a node another request computed), the seam fails a link, at the first slot after it.

``SequenceFault`` follows that: ``follow(inj, request, position)`` adds the slots the request
holds from ``position`` on to the injection's ``affected_slots`` after every forward, until it
stops running (finished requests keep their slots in the prefix cache; preempted ones re-prefill
from their history); and a violation of an idle prefix-cache slot (owner ``cache``: sweeps and
load-back checks) whose predecessor in the tree is affected becomes affected too, as
``Injection.follow_violations`` does for slots a request reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcanary.faults.base import Fault, Injection
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.reporting import Violation


class SequenceFault(Fault):
    def __init__(self, **gate):
        super().__init__(**gate)
        self._followed: list[tuple[Injection, int, int]] = []  # (injection, request id, first damaged position)

    def follow(self, inj: Injection, request_id: int, position: int) -> None:
        self._followed.append((inj, request_id, position))

    def after_forward(self, batch: ForwardBatch, step: int) -> None:
        keep = []
        for inj, rid, position in self._followed:
            req = self.engine.requests.get(rid)
            if req is None or not req.is_active:
                continue
            inj.affected_slots |= {s for s in req.slots[position:].tolist() if s > 0}
            keep.append((inj, rid, position))
        self._followed = keep

    def on_report(self, request_ids: Sequence, tables: torch.Tensor, violations: list[Violation]) -> None:
        super().on_report(request_ids, tables, violations)
        cached = [v for v in violations if "cache" in (r for r, _ in v.owners)]
        if not cached or self.engine.tree is None:
            return
        pred = {}  # slot -> the slot before it in the prefix cache
        for node in self.engine.tree.nodes():
            if node.is_on_host:
                continue
            slots = node.slots.tolist()
            first = int(node.parent.slots[-1]) if node.parent is not self.engine.tree.root else -1
            pred.update(zip(slots, [first, *slots[:-1]], strict=True))
        for inj in self.injections:
            inj.affected_slots |= {v.slot for v in cached
                                   if v.step >= inj.step and pred.get(v.slot) in inj.affected_slots}
