"""Byte flip right after TAIL in a slot the forward just wrote (a late stray write, a racing copy).

After TAIL of step k recorded the fingerprints of the slots the forward wrote, one bit is
flipped inside the fingerprinted bytes of a covered layer's K or V row of one of them: the
window between the fingerprint's record and the slot's first read. Its writer reads it in its
next forward, and the TAIL of that forward reports a fingerprint mismatch (HEAD reads no K/V
bytes). Only writers sure to run in step k + 1 are targets: they keep running after this step
and sit early enough in the running order that the token budget reaches them even when every
request before them takes a whole chunk. A slot freed before that forward (its writer was
aborted, preempted or retracted) was never read: the flip is discarded and the fault acts again.
"""

from __future__ import annotations

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.engine.request import RequestStatus
from kvcanary.faults.base import Expectation, flip_bit, pick_target
from kvcanary.faults.used_slot_flip import UsedSlotFlip
from kvcanary.runtime.batch import ForwardBatch


class WrittenSlotFlip(UsedSlotFlip):
    """``request_id``: the writer whose slot is flipped (None: any writer sure to run next step).
    Shares ``UsedSlotFlip``'s discard-and-re-arm when the slot is freed unread."""

    name = "written_slot_flip"
    expected = Expectation(LaunchPoint.TAIL, Reason.FINGERPRINT)

    def after_forward(self, batch: ForwardBatch, step: int) -> None:
        if not self.is_armed(step):
            return
        engine, cfg = self.engine, self.engine.config
        order = {r.request_id: k for k, r in enumerate(engine.scheduler.running)}
        starts = (batch.extend_lens.cumsum(0) - batch.extend_lens).tolist()
        writers = []
        for i, rid, prefix, extend in self.batch_requests(batch):
            req = engine.requests[rid]
            if self.request_id not in (None, rid) or req.status is not RequestStatus.RUNNING or extend == 0:
                continue
            samples = req.num_cached + extend == req.num_tokens
            keeps_running = req.max_new_tokens - len(req.output_ids) - samples >= 1
            # worst case for the next step: every running request before it takes a whole chunk
            is_scheduled = (order[rid] + 1) * cfg.chunk_size <= cfg.max_tokens_per_step
            if keeps_running and is_scheduled:
                writers.append((i, rid, prefix, extend))
        if not writers:
            self.skip(step, "no writer of this forward is sure to read its slots in the next step")
            return
        i, rid, prefix, extend = self.rng.choice(writers)
        j = self.rng.randrange(extend)
        slot = int(batch.out_cache_loc[starts[i] + j])
        layer, half, byte, bit = pick_target(self)
        before, after = flip_bit(engine, layer, half, slot, byte, bit)
        self._unread = self.record(step, slot, f"request={rid} position={prefix + j} written this step, "
                                               f"layer={layer} half={half.name} byte={byte} bit={bit} "
                                               f"0x{before:02x}->0x{after:02x}", set())
