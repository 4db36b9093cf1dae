"""Byte flip in a slot a running request reads (bit rot, a stray DMA, a bad kernel).

After TAIL of step k, one bit is flipped inside the fingerprinted bytes (the first 16 bytes of
the row with ``real_kv=partial``, anywhere with ``all``) of a covered layer's K or V row of a
slot that a request of the batch keeps reading. HEAD does not read K/V bytes; the TAIL of the
next step that reads the slot reports a fingerprint mismatch. Among the candidate slots it takes
one that most requests of the batch read. If the slot is freed before the next forward (its
only reader was aborted or preempted), nobody read the flip: it is discarded and the fault
acts again at a later step.
"""

from __future__ import annotations

from collections import Counter

import torch

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.faults.base import Expectation, Injection, RequestFault, flip_bit, log, pick_target
from kvcanary.runtime.batch import ForwardBatch


class UsedSlotFlip(RequestFault):
    """``request_id``: read by this request (None: any request of the batch that keeps running)."""

    name = "used_slot_flip"
    expected = Expectation(LaunchPoint.TAIL, Reason.FINGERPRINT)

    def __init__(self, **gate):
        super().__init__(**gate)
        self._unread: Injection | None = None  # the flip of the last step, until a forward reads it

    def before_forward(self, batch: ForwardBatch, step: int) -> None:
        self._unread = None

    def on_free(self, slots: torch.Tensor) -> None:
        inj = self._unread
        if inj is not None and inj.slot in set(slots.tolist()):
            self.injections.remove(inj)
            self._unread = None
            log.warning("fault %s: step=%d slot=%d freed before the next forward read it (its reader ended): "
                        "flip discarded, fault re-armed", self.name, inj.step, inj.slot)

    def after_forward(self, batch: ForwardBatch, step: int) -> None:
        if not self.is_armed(step):
            return
        engine = self.engine
        readers = []
        for i, rid, prefix, extend in self.batch_requests(batch):
            req = engine.requests[rid]
            samples = req.num_cached + extend == req.num_tokens
            if self.aims_at(rid) and req.max_new_tokens - len(req.output_ids) - samples >= 2:
                readers.append((i, rid, prefix + extend))
        if not readers:
            self.skip(step, "no request of the batch reads again in the next step")
            return
        # the slot most requests of the batch read: a shared prefix stays read when one reader is aborted
        rows, lens = batch.req_pool_indices.tolist(), (batch.prefix_lens + batch.extend_lens).tolist()
        readers_of = Counter(s for r, n in zip(rows, lens, strict=True) if r > 0
                             for s in set(batch.req_to_token[r, :n].tolist()))
        candidates = [(int(batch.req_to_token[rows[i], p]), rid, p) for i, rid, length in readers
                      for p in range(length)]
        most = max(readers_of[s] for s, _, _ in candidates)
        slot, rid, p = self.rng.choice([c for c in candidates if readers_of[c[0]] == most])
        layer, half, byte, bit = pick_target(self)
        before, after = flip_bit(engine, layer, half, slot, byte, bit)
        self._unread = self.record(step, slot, f"request={rid} position={p} layer={layer} half={half.name} "
                                               f"byte={byte} bit={bit} 0x{before:02x}->0x{after:02x}", set())
