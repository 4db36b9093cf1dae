"""Stale transfer writer: a transfer lands after its destination slots were freed and reused
(sglang#24527, vllm#45357).

The fault keeps the payload and destination slots of recent transfers. When one of those slots
has since been freed by the decode engine, handed to another sequence and is read by a
request of the next forward (at a position > 0), the old transfer's K/V and records land there,
as a late writer that nobody waited for before the free would. The decode engine's HEAD finds
the slot holding another prefix: its chain link fails (with position and, under token truth,
verify_token when those differ too).
"""

from __future__ import annotations

from collections import deque

import torch

from kvcanary.core.record import CHAIN, LaunchPoint, Reason, record_words
from kvcanary.engine.pd import TransferPayload
from kvcanary.faults._transfer import TransferFault
from kvcanary.faults.base import Expectation
from kvcanary.runtime.batch import ForwardBatch


class StaleTransferWrite(TransferFault):
    name = "stale_transfer_write"
    expected = Expectation(LaunchPoint.HEAD, Reason.CHAIN, Reason.POSITION | Reason.VERIFY_TOKEN)

    def __init__(self, *, keep: int = 16, **gate):
        super().__init__(**gate)
        self._sent: deque[tuple[TransferPayload, torch.Tensor, set[int]]] = deque(maxlen=keep)

    def after_receive(self, payload: TransferPayload, dst: torch.Tensor) -> None:
        if payload.records is not None and self.step >= self.warmup_steps and len(self.injections) == 0:
            self._sent.append((payload, dst.cpu().clone(), set()))  # set: its slots freed since

    def on_free(self, slots: torch.Tensor) -> None:
        freed = set(slots.tolist())
        for _, dst, gone in self._sent:
            gone |= freed & set(dst.tolist())

    def before_forward(self, batch: ForwardBatch, step: int) -> None:
        if not self._sent or not self.is_armed(step):
            return
        table, rows = batch.req_to_token, batch.req_pool_indices.tolist()
        read = {int(table[rows[i], p]): p for i, _, prefix, _ in self.batch_requests(batch)
                for p in range(1, prefix)}
        words = record_words(self.canary.state.records)
        for payload, dst, gone in self._sent:
            stale = record_words(payload.records)
            hits = [i for i, s in enumerate(dst.tolist()) if s in gone and s in read
                    and int(words[s, CHAIN]) != int(stale[i, CHAIN])]
            if not hits:
                continue
            index = dst[hits].to(self.engine.device)
            pool = self.engine.pool
            for layer, (k_buf, v_buf) in enumerate(zip(pool.k_buffers, pool.v_buffers, strict=True)):
                k_buf.index_copy_(0, index, payload.k[layer, hits].to(k_buf.device))
                v_buf.index_copy_(0, index, payload.v[layer, hits].to(v_buf.device))
            self.canary.land_rows(index, payload.records[hits], payload.signature)
            slots = [int(dst[i]) for i in hits]
            self.record(step, slots[0], f"transfer of request={payload.request_id} landed late on {len(hits)} slot(s) "
                                        f"freed and reused since: {slots[:8]}", set(slots))
            self._sent.clear()
            return
        self.skip(step, "no slot of a recent transfer was freed, reused and is read by this forward")
