"""Held slots (``Canary.hold``, ``sweep(..., hold=True)``) on every HEAD path of the CPU: the
Triton check (interpreted), the compiled CPU kernel and the ops one by one. A hold reaches the next
HEAD and that HEAD only: a write into a held slot is a READ_CONFLICT at HEAD naming the cache
(row 0); a second HEAD, or a HEAD after ``end_step`` dropped a hold no HEAD read, reports nothing.
The Triton check reads the holds counted on the device (``ops.conflicts``' held words), as a HEAD
replayed from a CUDA graph does (``test_sweep_cuda.py``); its HEAD sets the count to 0."""

from __future__ import annotations

import pytest
import torch

from kvcanary.core.record import Reason
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.canary import Canary
from kvcanary.runtime.sweep import SweepRun

from ._helpers import prefilled, read_all

NUM_SLOTS, ROWS, CTX = 300, 4, 64
# the CPU's HEAD paths: the Triton kernel interpreted (where no GPU is: its case there is
# test_sweep_cuda.py's), the compiled CPU kernel, the ops one by one
INTERPRETED = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test")
PATHS = [pytest.param(True, marks=INTERPRETED), None, False]
PATH_IDS = ["triton", "cpu-kernel", "ops"]


def _canary(seed: int, fused) -> tuple[Canary, list[list[int]], list[list[int]], list[int]]:
    c, slots, tokens = prefilled(seed, "cpu", NUM_SLOTS, CTX, 12, 256, fused=fused)
    free = sorted(set(range(1, NUM_SLOTS)) - set(sum(slots, [])))
    return c, slots, tokens, free


def _head(c: Canary, slots: list[int], token: int) -> None:
    """HEAD of a forward of one request (row 1, nothing cached) writing ``slots``."""
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    table = torch.zeros(ROWS, CTX, dtype=torch.int32)
    table[1, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
    b = ForwardBatch(i64([1]), i64([0]), i64([len(slots)]), table, i64([token] * len(slots)),
                     i64(list(range(len(slots)))), i64(slots))
    c.prepare_head(b)
    c.launch_head(b)


def _conflicts(found: list) -> list[tuple]:
    return [(v.slot, v.point.name, v.expected_value) for v in found if v.reasons & Reason.READ_CONFLICT]


def _count(c: Canary) -> int | None:
    words = c.holds.counted
    return None if words is None else int(words[0])


def _counted(fused, n: int) -> int | None:
    """The count of holds on the device a path keeps: the Triton HEAD's (``fused=True``); the
    others keep none."""
    return n if fused is True else None


@pytest.mark.parametrize("fused", PATHS, ids=PATH_IDS)
def test_a_hold_reaches_the_next_head_and_that_head_only(fused):
    c, slots, _, free = _canary(21, fused)
    held = slots[0][:6]
    c.hold(torch.tensor(held, dtype=torch.int64))
    assert _count(c) == _counted(fused, 6)
    _head(c, free[:3], 7)  # the clean twin: no write into a held slot
    assert _count(c) == _counted(fused, 0)
    assert read_all(c, 1) == []
    target = held[3]
    c.hold(torch.tensor(held, dtype=torch.int64))
    _head(c, [free[3], target], 9)
    assert _conflicts(read_all(c, 3)) == [(target, "HEAD", 0)]
    c.hold(torch.tensor(held, dtype=torch.int64))
    _head(c, [free[4]], 5)  # reads the hold
    _head(c, [free[5], target], 5)  # a second HEAD in the step: no hold left
    assert _conflicts(read_all(c, 5)) == []
    assert _count(c) == _counted(fused, 0)


@pytest.mark.parametrize("fused", PATHS, ids=PATH_IDS)
def test_a_hold_no_head_read_is_dropped_at_the_end_of_its_step(fused):
    c, slots, _, free = _canary(22, fused)
    target = slots[1][2]
    c.hold(torch.tensor(slots[1][:5], dtype=torch.int64))
    assert read_all(c, 1) == []  # a step without a forward
    assert _count(c) == _counted(fused, 0)
    _head(c, [free[0], target], 3)
    assert _conflicts(read_all(c, 3)) == []


@pytest.mark.parametrize("fused", PATHS, ids=PATH_IDS)
def test_a_sweep_that_holds_its_runs_holds_every_slot_for_the_next_head(fused):
    c, slots, tokens, free = _canary(23, fused)
    runs = [SweepRun(torch.tensor(s, dtype=torch.int64), tuple(t), 0, -1) for s, t in zip(slots, tokens, strict=True)]
    every = sum(slots, [])
    c.sweep(runs, hold=True)
    assert c.held.tolist() == every
    assert _count(c) == _counted(fused, len(every))
    target = every[len(every) // 2]
    _head(c, [free[0], target], 4)
    assert _conflicts(read_all(c, 2)) == [(target, "HEAD", 0)]


@INTERPRETED
def test_the_triton_head_reads_the_count_on_the_device_not_the_hosts_view():
    """The Triton HEAD checks what the counted words hold when it runs (as a replayed HEAD does):
    a count written on the device after the hold moves what it checks."""
    c, slots, _, free = _canary(24, True)
    held = slots[2][:8]
    c.hold(torch.tensor(held, dtype=torch.int64))
    c.holds.counted[0] = 2  # the device's count: only the first two slots
    _head(c, [free[0], held[5]], 6)
    assert _conflicts(read_all(c, 1)) == []
    c.hold(torch.tensor(held, dtype=torch.int64))
    _head(c, [free[1], held[1]], 6)
    assert _conflicts(read_all(c, 3)) == [(held[1], "HEAD", 0)]


@pytest.mark.parametrize("fused", PATHS, ids=PATH_IDS)
def test_a_hold_of_more_slots_than_the_pool_has_holds_each_slot_once(fused):
    """A cache that holds a slot in two places (a bug the canary is there to find) hands more slots
    than the pool has: every distinct slot is still held, and a write into one is reported."""
    c, slots, _, free = _canary(25, fused)
    target = slots[0][4]
    twice = torch.tensor((slots[0] + slots[1]) * (NUM_SLOTS // len(slots[0] + slots[1]) + 1), dtype=torch.int64)
    assert twice.shape[0] > NUM_SLOTS
    c.hold(twice)
    assert sorted(set(c.held.tolist())) == sorted(set(slots[0] + slots[1]))
    _head(c, [free[0], target], 8)
    assert _conflicts(read_all(c, 1)) == [(target, "HEAD", 0)]


@pytest.mark.parametrize("fused", PATHS, ids=PATH_IDS)
def test_a_write_into_the_one_held_slot(fused):
    """Exactly one slot held (the smallest hold there is): a write into it is one READ_CONFLICT
    naming the cache; its twin, a write beside it, reports nothing."""
    c, slots, _, free = _canary(26, fused)
    target = slots[1][0]
    c.hold(torch.tensor([target], dtype=torch.int64))
    assert _count(c) == _counted(fused, 1)
    _head(c, [free[0], free[1]], 4)
    assert read_all(c, 1) == []
    c.hold(torch.tensor([target], dtype=torch.int64))
    _head(c, [free[2], target], 4)
    found = read_all(c, 3)
    assert _conflicts(found) == [(target, "HEAD", 0)] and len(found) == 1
