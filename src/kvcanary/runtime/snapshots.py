"""Where a CUDA step's counters land on the host without allocating: two preallocated rings.

| ring            | written by                                         | read when                         |
|-----------------|----------------------------------------------------|-----------------------------------|
| ``Publication`` | a kernel captured after TAIL in the step's graph   | its row shows the expected        |
|                 | (``ops.publish``), or launched by ``end_step``     | sequence number (a step late)     |
|                 | after eager forwards: the block and a sequence word|                                   |
| ``CopyRows``    | ``end_step`` where the device cannot publish: one  | its event completed (a step late) |
|                 | copy of the counter block into a pinned row, one   |                                   |
|                 | event record                                       |                                   |

A row holds the counter block: ``ring_counter | stats | error`` (``DeviceState.counter_block()``).
A replayed graph publishes its own counters, so ``end_step`` after a replay makes no CUDA call
at all. An eager TAIL publishes from its own launch (its last program out, ``ops.check``), so
``end_step`` after it makes no call either, unless the canary launched something after that TAIL
(a sweep, a landed copy's check, another HEAD): then ``end_step`` launches the publication (a
copy and an event record, two calls, where the device cannot publish). The host counts the
publications it expects (one a replay, one an eager TAIL, one a launch); when the expected row
does not arrive (a replay without TAIL, replays without ``end_step``) the reader synchronises
and falls back to the block as it is then, and counts on from the device's sequence number.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kvcanary.ops.publish import BoundPublish

SPIN_CHECK_S = 1e-3  # while waiting for a published row, look this often whether the stream went idle


class CopyRows:
    """Pinned rows with one reusable event each: a row is taken at a snapshot and given back once
    read (more rows are made only when more snapshots are pending than ever before)."""

    def __init__(self, width: int, device: torch.device, rows: int = 4):
        self.width, self.device = width, device
        self.rows: list[torch.Tensor] = []
        self.views: list[np.ndarray] = []  # numpy views of the rows: reads without torch dispatch
        self.words: list[memoryview] = []  # ... and as memoryviews: copied out without numpy
        self.events: list[torch.Event] = []  # recorded on the current stream in C++: no Python stream lookup
        self.free: list[int] = []
        for _ in range(rows):
            self._grow()

    def _grow(self) -> None:
        row = torch.zeros(self.width, dtype=torch.int64, pin_memory=True)
        self.free.append(len(self.rows))
        self.rows.append(row)
        self.views.append(row.numpy())
        self.words.append(memoryview(self.views[-1]))
        self.events.append(torch.Event(device=self.device))

    def take(self) -> int:
        if not self.free:
            self._grow()
        return self.free.pop()


class Publication:
    """The publish ring of one counter block: ``rows[k] = [seq, block...]`` (pinned), written by
    ``launch()`` (captured into a graph), read by ``read(seq)``."""

    def __init__(self, block: torch.Tensor, num_rows: int = 8):
        self.block = block
        self.seq = torch.zeros(1, dtype=torch.int64, device=block.device)
        self.rows = torch.zeros(num_rows, 1 + block.shape[0], dtype=torch.int64, pin_memory=True)
        self.view = self.rows.numpy()
        # the rows' words, read with CPython's indexing (numpy is cold per step); row k's sequence word
        # at ``k * width`` (``Reporter._read`` reads an arrived row itself, then ``read_into``'s wait)
        self.words = memoryview(self.view.reshape(-1))
        self.num_rows, self.width = self.view.shape
        self.expected = 0  # sequence number of the last publication the host counted on
        self.fallbacks = 0  # reads that found no row and took the block after a synchronise
        self._publish = BoundPublish(block, self.seq, self.rows)

    def launch(self) -> None:
        """Publish the block now, on the current stream (a graph captures it after TAIL; an eager
        step's ``end_step`` launches it)."""
        self._publish()

    def probe(self) -> bool:
        """Publish once eagerly (compiles the kernel) and check that the row arrived whole; counts
        on from there. False when this device cannot publish into pinned memory."""
        self.rows.fill_(-1)  # so the probe sees every word written
        try:
            self.launch()
            torch.cuda.synchronize(self.block.device)
        except Exception:  # noqa: BLE001 - no host-mapped pinned memory, or no such instruction: use copies
            return False
        s = int(self.seq[0])
        self.expected = s
        row = self.view[s % self.view.shape[0]]
        return s == 1 and int(row[0]) == s and np.array_equal(row[1:], self.block.cpu().numpy())

    def read_into(self, seq: int, out: memoryview) -> None:
        """Copy the block words of publication ``seq`` into ``out`` (int64 words; waits while the
        device has not reached it); after a synchronise, the block as it is then when that
        publication never came."""
        w, k = self.words, self.width
        base = seq % self.num_rows * k
        if w[base] != seq:
            self._wait(self.view[seq % self.num_rows], seq)
        if w[base] == seq:
            out[:] = w[base + 1: base + k]
            if w[base] == seq:  # not overwritten while copied
                return
        torch.cuda.synchronize(self.block.device)
        if w[base] == seq:
            out[:] = w[base + 1: base + k]
            return
        self.fallbacks += 1
        self.expected = int(self.seq[0])
        out[:] = memoryview(self.block.cpu().numpy())

    def _wait(self, row: np.ndarray, seq: int) -> None:
        stream = torch.cuda.current_stream(self.block.device)
        t = time.perf_counter()
        while row[0] < seq:
            if time.perf_counter() - t > SPIN_CHECK_S:
                if stream.query():  # idle and still not there: it will not come on this stream
                    return
                t = time.perf_counter()
