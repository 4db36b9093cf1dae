"""CUDA: a sweep's device half as one graph replay.

Loading the sweep plan on CUDA takes four calls: copy the staged entries from pinned host words
to the device, spread them into the plan's columns, set the plan's count, launch the verify. Each
costs tens of µs where an engine calls it, between its model's launches (caches cold). A
``SweepGraphs`` captures those four once per size class (the first ``m`` entries of each column;
classes from 256 entries up to the plan's capacity, a factor of 4 apart) when the canary warms
up. A sweep then writes its entries and their count into the pinned words and replays the
smallest class that holds them: one call, and one event record, so that the next sweep does not
rewrite words the copy has not read yet. The graphs also widen the plan's slots into ``held``
(int64, their count first: ``ops.conflicts``' counted held slots): a sweep that holds every slot
of its runs and verifies them all, in order, copies those words into the canary's held words on
the device (one copy) instead of staging the slots again.

| words (int32)             | what                                                          |
|---------------------------|---------------------------------------------------------------|
| ``[0, 4m)``               | slot, pred, position, token: 4 rows of ``m`` (entry = slot is |
|                           | copied on the device)                                         |
| ``[4m, 5m)``              | unused                                                        |
| ``[c, c + 2)``, c = 5m rounded up to even | the count, one int64                          |

Entries past the count in a class's rows are left from earlier sweeps: the verify reads only the
first ``count``. The plan's ``row`` column stays 0 (nothing else writes this plan's).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvcanary.ops.plan import Plan
from kvcanary.runtime.capture import collection_paused

SMALLEST = 256  # entries of the smallest class
STEP = 4  # each class this many times the one before


def class_sizes(capacity: int) -> list[int]:
    """The entry counts of the classes for a plan of ``capacity`` entries: 256, 1024, ... and the
    capacity itself last."""
    sizes, m = [], SMALLEST
    while m < capacity:
        sizes.append(m)
        m *= STEP
    sizes.append(capacity)
    return sizes


def _count_word(m: int) -> int:
    """Where a class of ``m`` entries keeps its count: the first even word after its rows (an
    int64 view needs 8-byte alignment)."""
    return (5 * m + 1) // 2 * 2


def staging_words(capacity: int) -> int:
    """The int32 words of the pinned staging (and of its device landing) for a plan of ``capacity``
    entries: the largest class's rows and count."""
    return _count_word(capacity) + 2


class SweepGraphs:
    """One captured graph per size class loading ``plan`` (through ``block``, its entry columns as
    one [6, capacity] block) and launching ``verify`` (a callable that launches the plan's verify
    on the current stream, capturable: a ``BoundVerify`` with its tag). ``staging`` (pinned) and
    ``landing`` (on the plan's device): int32 words, ``staging_words(capacity)`` of them;
    ``read``: the event of the last copy out of ``staging``; ``check``: raises where the buffers
    the graphs write moved since (``DeviceState.check``), called before every replay. Captures on
    construction; call it where no capture is under way."""

    def __init__(self, plan: Plan, block: torch.Tensor, verify: Callable[[], None], staging: torch.Tensor,
                 landing: torch.Tensor, read: torch.Event, check: Callable[[], None]):
        device = block.device
        self.sizes = class_sizes(plan.capacity)
        if staging.numel() < staging_words(plan.capacity) or landing.numel() < staging.numel():
            raise ValueError(f"sweep staging of {staging.numel()} and landing of {landing.numel()} words < "
                             f"{staging_words(plan.capacity)} (plan capacity {plan.capacity})")
        self.device, self.read, self.check = device, read, check
        # the loaded entries' count, then their slots, widened: ``ops.conflicts``' counted held slots
        self.held = torch.zeros(1 + plan.capacity, dtype=torch.int64, device=device)
        host = staging.numpy()
        self._rows = [host[: 5 * m].reshape(5, m) for m in self.sizes]
        self._counts = [host[_count_word(m): _count_word(m) + 2].view(np.int64) for m in self.sizes]
        self._last = 0  # the class the plan was last loaded through
        stream = torch.cuda.Stream(device=device)
        current = torch.cuda.current_stream(device)
        stream.wait_stream(current)
        pool = torch.cuda.graph_pool_handle()
        self.graphs = []
        with collection_paused():
            for m in self.sizes:
                c = _count_word(m)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.stream(stream):
                    g.capture_begin(pool=pool, capture_error_mode="thread_local")
                    try:
                        landing[: c + 2].copy_(staging[: c + 2], non_blocking=True)
                        block[:4, :m].copy_(landing[: 4 * m].view(4, m))
                        block[4, :m].copy_(block[0, :m])  # entry = slot
                        plan.count.copy_(landing[c: c + 2].view(torch.int64))
                        self.held[:1].copy_(plan.count)
                        self.held[1: 1 + m].copy_(block[0, :m])
                        verify()
                    finally:
                        g.capture_end()
                self.graphs.append(g)
        current.wait_stream(stream)

    @property
    def capacity(self) -> int:
        return self.sizes[-1]

    def load(self, cols: Sequence, n: int) -> None:
        """Load the plan with ``n`` entries (``cols``: slot, pred, position, token; int64 arrays or
        sequences of n integers, at most ``capacity``) and verify them, on the current stream."""
        self.check()
        k = bisect.bisect_left(self.sizes, n)  # the smallest class that holds n
        self.read.synchronize()  # a sweep or more old: long done
        rows = self._rows[k]
        for i in range(4):
            rows[i, :n] = cols[i]  # cast to int32 as they are written
        self._replay(k, n)

    def load_blocks(self, blocks: Sequence[np.ndarray], n: int) -> None:
        """``load`` of the concatenation of ``blocks`` (int64 [4, n_i] arrays: slot, pred, position,
        token; ``n`` entries in all, at most ``capacity``), written into the pinned rows in one
        copy."""
        self.check()
        k = bisect.bisect_left(self.sizes, n)  # the smallest class that holds n
        self.read.synchronize()  # a sweep or more old: long done
        if blocks:
            np.concatenate(blocks, axis=1, out=self._rows[k][:4, :n], casting="same_kind")  # cast to int32
        self._replay(k, n)

    def _replay(self, k: int, n: int) -> None:
        self._counts[k][0] = n
        self._last = k
        self.graphs[k].replay()
        self.read.record()  # on the current stream, in C++

    def again(self) -> None:
        """Verify the entries the last ``load`` staged (they are still in the pinned words)."""
        self.check()
        self.graphs[self._last].replay()
        self.read.record()  # on the current stream, in C++
