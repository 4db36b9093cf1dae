"""Canary stamp corruption: one bit of a live slot's record flips (the canary buffer itself is hit).

Before HEAD, one bit of the chain or position word of the record of a slot that a request of
the batch reads as prefix is flipped; the slot's K/V is untouched. HEAD reads the record at
once: a damaged chain fails the slot's own link (chain), a damaged position fails the position
check (position). The successor's link is computed from the damaged record, so it fails too
(chain, at the successor); when the slot is the seed of a request's write, the written slot
reports write_position (position field) or inherits the damaged chain consistently (chain field).
"""

from __future__ import annotations

import enum

from kvcanary.core.hashing import MASK64, to_signed
from kvcanary.core.record import CHAIN, POSITION, LaunchPoint, Reason, record_words
from kvcanary.errors import ConfigError
from kvcanary.faults._follow import SequenceFault
from kvcanary.faults.base import Expectation, RequestFault
from kvcanary.runtime.batch import ForwardBatch


class StampField(enum.Enum):
    """The record word the fault damages, and the reason HEAD reports for it."""

    CHAIN = "chain"
    POSITION = "position"

    @property
    def word(self) -> int:
        return CHAIN if self is StampField.CHAIN else POSITION

    @property
    def reason(self) -> Reason:
        return Reason.CHAIN if self is StampField.CHAIN else Reason.POSITION


class StampCorruption(SequenceFault, RequestFault):
    """``field``: the record word to damage (``StampField`` or its value); ``request_id``: the slot
    is read by this request (None: any request of the batch that reads a prefix)."""

    name = "stamp_corruption"
    expected = Expectation(LaunchPoint.HEAD, Reason.CHAIN)

    def __init__(self, *, field: StampField | str = StampField.CHAIN, **gate):
        super().__init__(**gate)
        try:
            self.field = StampField(field)
        except ValueError:
            raise ConfigError(f"StampCorruption field must be one of {[f.value for f in StampField]}, "
                              f"got {field!r}") from None
        self.expected = Expectation(LaunchPoint.HEAD, self.field.reason)

    def before_forward(self, batch: ForwardBatch, step: int) -> None:
        if not self.is_armed(step):
            return
        if self.canary is None:
            self.skip(step, "needs a canary whose records it can damage")
            return
        readers = [r for r in self.batch_requests(batch) if r[2] > 0 and self.aims_at(r[1])]
        if not readers:
            self.skip(step, "no target request reads a prefix in this forward")
            return
        i, rid, prefix, extend = self.rng.choice(readers)
        table, rows = batch.req_to_token, batch.req_pool_indices.tolist()
        p = self.rng.randrange(prefix)
        slot = int(table[rows[i], p])
        # every reader's successor of the slot checks its link against the damaged record; a
        # request that writes right after it chains its new slots from the damaged record
        successors, writers = set(), []
        for j, rid_j, n, e in self.batch_requests(batch):
            row = table[rows[j], : n + e]
            hits = (row[:n] == slot).nonzero().flatten().tolist()
            successors |= {int(row[q + 1]) for q in hits if q + 1 < n + e}
            writers += [(rid_j, n) for q in hits if q == n - 1 and e > 0]
        bit = self.rng.randrange(64)
        words = record_words(self.canary.state.records)
        before = int(words[slot, self.field.word]) & MASK64
        after = before ^ (1 << bit)
        words[slot, self.field.word] = to_signed(after)
        inj = self.record(step, slot, f"request={rid} position={p} record {self.field.value} bit={bit} "
                                      f"0x{before:016x}->0x{after:016x}", successors)
        for rid_w, position in writers:
            self.follow(inj, rid_w, position)
