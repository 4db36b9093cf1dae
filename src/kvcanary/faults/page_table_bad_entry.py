"""Page-table entry that resolves to no slot (the padding slot 0, a negative or out-of-pool slot).

Before HEAD, one prefix entry ``req_to_token[row, p]`` of a running request is set to 0 (the
padding slot, what a cleared or never-filled entry holds) or -1 (a padding id, which the reference
engine's gather takes for the pool's last slot): the forward reads whatever lies there. HEAD
reports it as bad_entry naming the request, the position and the entry's value (no record is
read; the next position's chain link is skipped, its predecessor being unresolvable), so
recompute re-prefills that request. Entries past the pool are named the same way (tests/ops);
the reference model would index past its buffers on them, so this injector does not write them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.faults.base import Expectation, Fault, Injection
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.reporting import Violation


@dataclass(eq=False)
class EntryInjection(Injection):
    """A bad entry: explains the bad_entry rows that name its request at its position."""

    request_id: int = -1
    position: int = -1

    def explains(self, v: Violation) -> bool:
        named = (self.request_id, self.position) in v.owners
        return v.step >= self.step and (bool(v.reasons & Reason.BAD_ENTRY) and named or super().explains(v))


class PageTableBadEntry(Fault):
    """``request_id``: the request whose page table is damaged (None: a random one of the batch)."""

    name = "page_table_bad_entry"
    expected = Expectation(LaunchPoint.HEAD, Reason.BAD_ENTRY)

    def __init__(self, *, request_id: int | None = None, **gate):
        super().__init__(**gate)
        self.request_id = request_id

    def before_forward(self, batch: ForwardBatch, step: int) -> None:
        if not self.is_armed(step):
            return
        victims = [r for r in self.batch_requests(batch) if r[2] > 0 and self.request_id in (None, r[1])]
        if not victims:
            self.skip(step, "needs a request with a prefix")
            return
        i, rid, prefix, _ = self.rng.choice(victims)
        row, p = int(batch.req_pool_indices[i]), self.rng.randrange(prefix)
        value = self.rng.choice([0, 0, -1])
        old = int(batch.req_to_token[row, p])
        batch.req_to_token[row, p] = value
        inj = EntryInjection(self.name, step, old, f"request={rid} position={p}: req_to_token[{row}, {p}] {old} -> "
                             f"{value}", set(), request_id=rid, position=p)
        self.injections.append(inj)
        self.record_log(step, inj)
