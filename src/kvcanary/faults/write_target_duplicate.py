"""Two tokens of one forward written to one slot (an allocator handing a slot out twice).

Before HEAD, the write target of one token of the batch is pointed at the target of an earlier
token of the batch (another request's, or the same request's), while the second token's page
table still points at its own slot: the model writes both tokens' K/V into the first slot (the
later one wins) and never writes the second slot, so the first request attends to another
token's K/V in this very forward. HEAD's write-conflict check reports write_conflict before the
model runs, naming both requests, so recompute redoes this forward rather than later ones.
"""

from __future__ import annotations

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.faults.base import Expectation, Fault
from kvcanary.runtime.batch import ForwardBatch


class WriteTargetDuplicate(Fault):
    name = "write_target_duplicate"
    expected = Expectation(LaunchPoint.HEAD, Reason.WRITE_CONFLICT, Reason.READ_CONFLICT)

    def before_forward(self, batch: ForwardBatch, step: int) -> None:
        if not self.is_armed(step):
            return
        lanes = []  # (token index, request id) of real requests' written tokens
        start = 0
        for i, rid, _, extend in self.batch_requests(batch):
            start = int(batch.extend_lens[:i].sum())
            lanes += [(start + k, rid) for k in range(extend)]
        if len(lanes) < 2:
            self.skip(step, "needs two written tokens in the batch")
            return
        (t1, rid1), (t2, rid2) = sorted(self.rng.sample(lanes, 2))
        slot, own = int(batch.out_cache_loc[t1]), int(batch.out_cache_loc[t2])
        batch.out_cache_loc[t2] = slot
        self.record(step, slot, f"token {t2} of request={rid2} written to slot {slot} (request={rid1}'s target; "
                                f"its own slot {own} stays unwritten)", {own})
