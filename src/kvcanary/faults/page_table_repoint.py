"""Page-table entry repointed to another live slot (a page-table bookkeeping bug).

Before HEAD, one prefix entry ``req_to_token[row, p]`` of a running request is pointed at a slot
another request of the batch reads at a different position: the forward reads the wrong K/V.
HEAD sees it first: the slot's chain does not continue the request's prefix (chain) and its
stored position is not ``p`` (position), and with token truth it holds another token
(verify_token).
"""

from __future__ import annotations

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.faults.base import Expectation, RequestFault
from kvcanary.runtime.batch import ForwardBatch


class PageTableRepoint(RequestFault):
    """``request_id``: the request whose page table is damaged (None: a random one of the batch)."""

    name = "page_table_repoint"
    expected = Expectation(LaunchPoint.HEAD, Reason.CHAIN,
                           Reason.POSITION | Reason.VERIFY_TOKEN | Reason.WRITE_POSITION)

    def before_forward(self, batch: ForwardBatch, step: int) -> None:
        if not self.is_armed(step):
            return
        reqs = [r for r in self.batch_requests(batch) if r[2] > 0]
        victims = [r for r in reqs if self.aims_at(r[1])]
        if not victims or len(reqs) < 2:
            self.skip(step, "needs a target request with a prefix and another request that reads one")
            return
        i, rid, prefix, extend = self.rng.choice(victims)
        table = batch.req_to_token
        row = int(batch.req_pool_indices[i])
        own = set(table[row, : prefix + extend].tolist())
        p = self.rng.randrange(prefix)
        donors = [(int(batch.req_pool_indices[j]), q) for j, _, n, _ in reqs if j != i for q in range(n) if q != p]
        donors = [(r, q) for r, q in donors if int(table[r, q]) not in own]
        if not donors:
            self.skip(step, f"no other request's slot outside request {rid}'s page table")
            return
        donor_row, q = self.rng.choice(donors)
        slot, old = int(table[donor_row, q]), int(table[row, p])
        table[row, p] = slot
        successor = {int(table[row, p + 1])} if p + 1 < prefix + extend else set()
        self.record(step, slot, f"request={rid} position={p}: req_to_token[{row}, {p}] {old} -> {slot} "
                                f"(slot of row {donor_row} at position {q})", successor)
