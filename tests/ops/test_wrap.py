"""The ops' long-lived words across their wrap points.

- ``check_writes``' marks (Triton): started at EPOCH_LIMIT - 2 (``WriteMarks.set_epoch``), four
  launches cross the restart; conflicts on slots marked just before it are found after it, with
  the reference's rows, on both backends; the epoch reads EPOCH_LIMIT - 1, 0, 1, 2 after them. On
  CUDA the same launches replayed from one captured graph restart inside the replay.
- ``check_forward``'s look-back (``_look_back``): a flag of the launch before is never taken for
  this launch's, at the epochs where ``4 * epoch`` and the epoch word wrap.
"""

from __future__ import annotations

import pytest
import torch

from kvcanary.core.record import Reason, new_ring, new_stats
from kvcanary.errors import InputError
from kvcanary.ops._common import Backend, tl, triton
from kvcanary.ops.check_kernel import _look_back
from kvcanary.ops.conflicts import EPOCH_LIMIT, UNMARKED, WriteMarks, check_writes
from kvcanary.ops.plan import Plan, build_plan
from kvcanary.ops.state import DeviceState, Workspace

from ._helpers import BACKEND_IDS, BACKENDS, TRITON_DEVICE, device_for, ring_rows

HEAD = 0
WC, RC = int(Reason.WRITE_CONFLICT), int(Reason.READ_CONFLICT)
NUM_SLOTS = 16
# row 1 reads slots 3, 4 and row 2 reads slot 5 at every launch; each launch writes 2 tokens a row
TABLE = {1: [3, 4, 10, 11], 2: [5, 12, 13]}
# per launch: the write targets, and the rows they give. Launch 1 (the last epoch before the restart)
# marks 10, 11, 12, 13 as written and 3, 4, 5 as read; launches 2 and 3 (after it) conflict there
LAUNCHES = [
    ([10, 11, 12, 13], []),  # EPOCH_LIMIT - 2: the clean twin
    ([10, 11, 12, 11], [[HEAD, 11, 2, 74, -1, 2, 1, WC]]),  # EPOCH_LIMIT - 1: a duplicate
    ([10, 11, 11, 13], [[HEAD, 11, 1, 73, -1, 2, 1, WC]]),  # 0: the same slot, duplicated at another token
    ([5, 11, 12, 3], [[HEAD, 5, 2, 71, -1, 1, 2, RC], [HEAD, 3, 2, 74, -1, 2, 1, RC]]),  # 1: read slots written
    ([10, 11, 12, 13], []),  # 2: the clean twin again
]


def _batch(device: torch.device) -> dict:
    rtt = torch.zeros(3, 8, dtype=torch.int32)
    for row, slots in TABLE.items():
        rtt[row, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
    rpi = torch.tensor([1, 2])
    plan = build_plan(req_pool_indices=rpi, prefix_lens=torch.tensor([2, 1]), extend_lens=torch.tensor([2, 2]),
                      req_to_token=rtt, plan=Plan.allocate(8, 2))
    plan = Plan(**{k: v.to(device) for k, v in vars(plan).items()})
    ring, counter = new_ring(8, device)
    state = DeviceState(torch.zeros(NUM_SLOTS, 32, dtype=torch.uint8, device=device), ring, counter,
                        new_stats(device))
    return dict(state=state, plan=plan, input_ids=torch.tensor([71, 72, 73, 74], device=device),
                positions=torch.tensor([2, 3, 1, 2], device=device), req_pool_indices=rpi.to(device),
                write_offsets=plan.write_offsets[:3].clone(), tag=HEAD)


def _rows(b: dict) -> list[list[int]]:
    return sorted(ring_rows(b["state"].ring, b["state"].ring_counter))


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_conflicts_across_the_marks_restart_are_found(backend):
    device = device_for(backend)
    b = _batch(device)
    marks = WriteMarks.allocate(NUM_SLOTS, device)
    marks.set_epoch(EPOCH_LIMIT - 2)
    epochs, unmarked = [], []
    for loc, want in LAUNCHES:
        b["state"].ring_counter.zero_()
        check_writes(**b, out_cache_loc=torch.tensor(loc, device=device), marks=marks, backend=backend)
        assert _rows(b) == sorted(want), loc
        epochs.append(int(marks.epoch[0]))
        unmarked.append(int((marks.words == UNMARKED).sum()))
    if backend is Backend.TRITON:  # the launch that reached the limit restarted the marks
        assert epochs == [EPOCH_LIMIT - 1, 0, 1, 2, 3]
        # 4 written slots and 3 read marked, none left after the restart, then the slots marked since
        assert unmarked == [2 * NUM_SLOTS - 7, 2 * NUM_SLOTS, 2 * NUM_SLOTS - 6, 2 * NUM_SLOTS - 9,
                            2 * NUM_SLOTS - 9]
    else:  # the torch path keeps no marks
        assert epochs == [EPOCH_LIMIT - 2] * len(LAUNCHES)
        assert unmarked == [2 * NUM_SLOTS] * len(LAUNCHES)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_conflicts_across_the_marks_restart_are_found_in_graph_replays():
    device = torch.device("cuda")
    b = _batch(device)
    marks = WriteMarks.allocate(NUM_SLOTS, device)
    loc = torch.tensor(LAUNCHES[0][0], device=device)
    check_writes(**b, out_cache_loc=loc, marks=marks, backend=Backend.TRITON)  # compiles, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        check_writes(**b, out_cache_loc=loc, marks=marks, backend=Backend.TRITON)
    marks.set_epoch(EPOCH_LIMIT - 2)
    epochs = []
    for targets, want in LAUNCHES:
        loc.copy_(torch.tensor(targets))
        b["state"].ring_counter.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert _rows(b) == sorted(want), targets
        epochs.append(int(marks.epoch[0]))
    assert epochs == [EPOCH_LIMIT - 1, 0, 1, 2, 3]


def test_set_epoch_refuses_what_the_key_cannot_hold():
    marks = WriteMarks.allocate(4)
    for bad in (-1, EPOCH_LIMIT, 2.0, True):
        with pytest.raises(InputError, match="epoch"):
            marks.set_epoch(bad)
    assert int(marks.epoch[0]) == 0
    ws = Workspace.allocate(1, 1)
    for bad in (2**63, -(2**63) - 1, 1.5, False):
        with pytest.raises(InputError, match="epoch"):
            ws.set_epoch(bad)
    ws.set_epoch(2**63 - 1)
    assert ws.sync.tolist() == [0, 0, 0, 2**63 - 1]


@triton.jit
def _look_back_kernel(sum_ptr, flag_ptr, epoch_ptr, out_ptr, b, max_spins):
    carry, done = _look_back(sum_ptr, flag_ptr, b, tl.load(epoch_ptr) * 4, max_spins)
    tl.store(out_ptr, carry.to(tl.int64, bitcast=True))
    tl.store(out_ptr + 1, done.to(tl.int64))


def _look(flags: list[int], sums: list[int], epoch: int) -> list[int]:
    dev = TRITON_DEVICE
    out = torch.full((2,), -7, dtype=torch.int64, device=dev)
    i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
    _look_back_kernel[(1,)](i64(sums), i64(flags), i64([epoch]), out, len(flags) - 1, 8)
    return out.tolist()


def _word(v: int) -> int:
    return (v + 2**63) % 2**64 - 2**63


@pytest.mark.parametrize("epoch", [5, 2**61 - 1, 2**61, 2**62 + 3, 2**63 - 1, -(2**63)],
                         ids=["small", "4e-below-wrap", "4e-wraps", "4e-past-wrap", "word-max", "word-wrapped"])
def test_the_look_back_takes_this_launchs_flags_only(epoch):
    e4 = _word(4 * epoch)
    before = _word(4 * (epoch - 1))  # the launch before's flags
    sums = [100, 1000, 7, 70, 3, 30]
    # blocks 0..2 published this launch: 0 its inclusive sum, 1 and 2 their aggregates (no segment start)
    assert _look([_word(e4 + 3), _word(e4 + 1), _word(e4 + 1)], sums, epoch) == [1000 + 7 + 3, 1]
    assert _look([_word(e4 + 3), _word(e4 + 1), _word(e4 + 2)], sums, epoch) == [3, 1]  # 2 holds a start
    # block 2 still holds the launch before's inclusive sum, or its aggregate: not taken, the wait gives up
    assert _look([_word(e4 + 3), _word(e4 + 1), _word(before + 3)], sums, epoch) == [0, 0]
    assert _look([_word(e4 + 3), _word(e4 + 1), _word(before + 1)], sums, epoch) == [0, 0]
    # block 1 stale behind this launch's block 2: the walk stops there
    assert _look([_word(e4 + 3), _word(before + 3), _word(e4 + 1)], sums, epoch) == [3, 0]
