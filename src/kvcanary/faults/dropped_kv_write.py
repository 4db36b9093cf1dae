"""A K/V write of the forward that did not happen (a skipped store, a kernel that returned early, a
write masked off by a wrong predicate).

Between the canary's HEAD and the model's writes of step k, the fault takes the row of one slot
the forward writes (a real request's token) in one covered layer's K or V buffer, as HEAD left
it: HEAD's mark in its first 16 bytes, the stale bytes behind. Right before TAIL it puts that row
back, so the slot ends the forward holding exactly what it held after HEAD, as if the model's
store into it had never run (the forward's own attention read the written values; every later
forward reads the stale ones). TAIL finds HEAD's mark still there: MISSED_WRITE. With
``real_kv=none`` nothing is marked and the drop is invisible.
"""

from __future__ import annotations

import torch

from kvcanary.core.record import Half, LaunchPoint, Reason
from kvcanary.faults.base import Expectation, RequestFault, kv_row_bytes
from kvcanary.runtime.batch import ForwardBatch


def covered_layer(fault) -> tuple[int, Half]:
    """(layer, half) of a covered source (layer 0 K without one)."""
    canary = fault.canary
    sources = canary.sources if canary is not None else []
    if not sources:
        return 0, Half.K
    src = fault.rng.choice(sources)
    return src.layer, src.half


def pick_written(fault: RequestFault, batch: ForwardBatch) -> tuple[int, int, int] | None:
    """(request id, position, slot) of a token of a real request this forward writes, or None."""
    starts = (batch.extend_lens.cumsum(0) - batch.extend_lens).tolist()
    targets = [(i, rid, prefix, extend) for i, rid, prefix, extend in fault.batch_requests(batch)
               if extend > 0 and fault.aims_at(rid)]
    if not targets:
        return None
    i, rid, prefix, extend = fault.rng.choice(targets)
    j = fault.rng.randrange(extend)
    slot = int(batch.out_cache_loc[starts[i] + j])
    return (rid, prefix + j, slot) if slot > 0 else None


def is_capturing() -> bool:
    """Inside a CUDA-graph capture the hooks run once, not every replay: the faults stay out."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class DroppedKVWrite(RequestFault):
    """``request_id``: the writer whose write is dropped (None: any writer of the batch)."""

    name = "dropped_kv_write"
    expected = Expectation(LaunchPoint.TAIL, Reason.MISSED_WRITE)

    def __init__(self, **gate):
        super().__init__(**gate)
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (row view, its bytes after HEAD)

    def after_head(self, batch: ForwardBatch, step: int) -> None:
        self._pending = None
        if is_capturing() or not self.is_armed(step):
            return
        target = pick_written(self, batch)
        if target is None:
            self.skip(step, "no real request of the batch writes a slot")
            return
        rid, position, slot = target
        layer, half = covered_layer(self)
        row = kv_row_bytes(self.engine, layer, half, slot)
        self._pending = (row, row.clone())
        self.record(step, slot, f"request={rid} position={position} layer={layer} half={half.name}: "
                                "the forward's write of this row does not happen", set())

    def before_tail(self, batch: ForwardBatch, step: int) -> None:
        if self._pending is not None:
            row, after_head = self._pending
            row.copy_(after_head)
            self._pending = None
