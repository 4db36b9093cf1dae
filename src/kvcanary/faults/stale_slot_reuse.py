"""Stale-slot reuse (use-after-free): a slot still read by a running request is handed to another.

Before HEAD, one extend entry of a request that prefills is pointed at a prefix slot of another
running request (the victim), as if the allocator had handed out a slot freed too early: the
forward writes the new token's K/V there and HEAD stamps it with the new owner's record. The
victim reads the slot in the same forward, so HEAD's write-conflict check reports it before the
model runs: read_conflict, naming the writer and the victim (TAIL then also reports the victim's
broken chain and position).
"""

from __future__ import annotations

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.faults.base import Expectation, Fault
from kvcanary.runtime.batch import ForwardBatch


class StaleSlotReuse(Fault):
    """``victim_id``: the request whose slot is reused (None: a random running request)."""

    name = "stale_slot_reuse"
    expected = Expectation(LaunchPoint.HEAD, Reason.READ_CONFLICT)

    def __init__(self, *, victim_id: int | None = None, **gate):
        super().__init__(**gate)
        self.victim_id = victim_id

    def before_forward(self, batch: ForwardBatch, step: int) -> None:
        if not self.is_armed(step):
            return
        reqs = self.batch_requests(batch)
        writers = [r for r in reqs if r[3] >= 2]
        victims = [r for r in reqs if r[2] > 0 and self.victim_id in (None, r[1])]
        if not writers or not victims:
            self.skip(step, "needs a prefill in the batch and another request that reads a prefix")
            return
        table, rows = batch.req_to_token, batch.req_pool_indices.tolist()
        starts = [0]
        for n in batch.extend_lens.tolist():
            starts.append(starts[-1] + n)
        w, wid, w_prefix, w_extend = self.rng.choice(writers)
        victims = [r for r in victims if r[0] != w]
        if not victims:
            self.skip(step, f"no running request other than the writer {wid} reads a prefix")
            return
        v, vid, v_prefix, v_extend = self.rng.choice(victims)
        w_slots = set(table[rows[w], : w_prefix + w_extend].tolist())
        p = w_prefix + self.rng.randrange(w_extend - 1)  # not the last: its successor is known
        # another position: an identical prefix at the same position would make the overwrite harmless
        positions = [q for q in range(v_prefix) if q != p and int(table[rows[v], q]) not in w_slots]
        if not positions:
            self.skip(step, f"every prefix slot of request {vid} is shared with request {wid}")
            return
        q = self.rng.choice(positions)
        slot, old = int(table[rows[v], q]), int(table[rows[w], p])
        table[rows[w], p] = slot
        batch.out_cache_loc[starts[w] + p - w_prefix] = slot
        affected = {old, int(table[rows[w], p + 1])}
        if q + 1 < v_prefix + v_extend:
            affected.add(int(table[rows[v], q + 1]))
        self.record(step, slot, f"writer={wid} position={p} (own slot {old}) takes victim={vid}'s slot at "
                                f"position {q}", affected)
