"""DeviceState: validated once when built, identity-checked on every op call; check_forward's
waits are bounded, so a stale workspace raises the device error flag instead of hanging."""

from __future__ import annotations

import time

import pytest
import torch

from kvcanary.core.record import NUM_LAUNCH_TAGS, NUM_STATS, new_ring, new_stats
from kvcanary.errors import InputError, InputTypeError
from kvcanary.ops._common import HAS_TRITON, Backend
from kvcanary.ops.check import check_forward
from kvcanary.ops.plan import Plan
from kvcanary.ops.state import DeviceFlag, DeviceState, Workspace
from kvcanary.ops.verify import verify

from ._helpers import BACKENDS, TRITON_DEVICE, random_canary


def parts(num_slots: int = 8, cap: int = 4) -> dict:
    ring, counter = new_ring(cap)
    return dict(records=random_canary(torch.Generator().manual_seed(1), num_slots), ring=ring, ring_counter=counter,
                stats=new_stats())


def test_allocate_gives_zeroed_buffers_of_the_documented_shapes():
    s = DeviceState.allocate(10, ring_capacity=6, max_bs=3, max_tokens=2000)
    assert s.records.shape == (10, 32) and int(s.records.sum()) == 0
    assert s.ring.shape == (6, 8) and s.ring_counter.tolist() == [0] and s.error.tolist() == [0]
    assert s.stats.shape == (NUM_LAUNCH_TAGS, NUM_STATS)
    head, tail = s.workspaces
    assert head.max_bs == tail.max_bs == 3 and head.max_tokens == 2048
    assert s.num_slots == 10 and s.ring_capacity == 6


big = torch.zeros(64, dtype=torch.int64)


def test_counter_block_is_the_three_counters_back_to_back_and_none_for_buffers_built_apart():
    s = DeviceState.allocate(10, ring_capacity=6)
    block = s.counter_block()
    assert block is not None and block.shape == (2 + NUM_LAUNCH_TAGS * NUM_STATS,)
    gen = torch.Generator().manual_seed(9)
    stats = torch.randint(1, 2**40, (NUM_LAUNCH_TAGS, NUM_STATS), generator=gen)
    s.ring_counter.fill_(123456789)
    s.stats.copy_(stats)
    s.error.fill_(0x15)
    assert block[0] == 123456789 and block[1:-1].tolist() == stats.flatten().tolist() and block[-1] == 0x15
    block.zero_()  # the same memory
    assert int(s.ring_counter[0]) == 0 and int(s.stats.abs().sum()) == 0 and int(s.error[0]) == 0
    assert DeviceState(**parts()).counter_block() is None


@pytest.mark.parametrize(("change", "exc", "fragment"), [
    (dict(records=torch.zeros(8, 32, dtype=torch.int8)), InputTypeError, "state.records dtype int8 != uint8"),
    (dict(records=torch.zeros(8, 16, dtype=torch.uint8)), InputError, "state.records must be uint8[num_slots, 32]"),
    (dict(records=torch.zeros(1, 32, dtype=torch.uint8)), InputError, "state.records has 1 slots < 2"),
    (dict(records=torch.zeros(8, 64, dtype=torch.uint8)[:, :32]), InputError, "state.records must be contiguous"),
    (dict(ring=torch.zeros(0, 8, dtype=torch.int64)), InputError, "state.ring has 0 rows"),
    (dict(ring_counter=torch.zeros(0, dtype=torch.int64)), InputError, "state.ring_counter must be int64[1]"),
    (dict(ring_counter=torch.zeros(2, dtype=torch.int64)), InputError, "state.ring_counter must be int64[1]"),
    (dict(stats=torch.zeros(NUM_STATS, NUM_LAUNCH_TAGS, dtype=torch.int64).t()), InputError,
     "state.stats must be contiguous"),
    (dict(stats="x"), InputTypeError, "state.stats must be a torch.Tensor, got str"),
    (dict(error=torch.zeros(1, dtype=torch.int64)), InputTypeError, "state.error dtype int64 != int32"),
    (dict(ring_counter=torch.zeros(1, dtype=torch.int64, device="meta")), InputError,
     "state.ring_counter is on meta but state.records is on cpu"),
    (dict(ring=big[:32].view(4, 8), ring_counter=big[31:32]), InputError,
     "state buffers ring and ring_counter share memory"),
    (dict(workspaces=(Workspace.allocate(1, 1),)), InputError, "holds 1 workspaces, expected 0 or 2"),
    (dict(workspaces=("a", "b")), InputTypeError, "state.workspaces[0] must be a Workspace, got str"),
    (dict(source_tags=torch.zeros(7, dtype=torch.int64)), InputError, "state.source_tags length 7 != num_slots"),
    (dict(source_tags=torch.zeros(8, dtype=torch.int32)), InputTypeError, "state.source_tags dtype int32 != int64"),
])
def test_construction_errors_name_the_buffer(change, exc, fragment):
    with pytest.raises(exc) as info:
        DeviceState(**(parts() | change))
    assert fragment in str(info.value)


def test_a_workspace_shared_by_both_launch_points_is_refused():
    ws = Workspace.allocate(2, 8)
    with pytest.raises(InputError, match=r"workspaces\[0\]\.\w+ and workspaces\[1\]\.\w+ share memory"):
        DeviceState(**parts(), workspaces=(ws, ws))


def test_hand_built_workspace_of_wrong_lengths_is_refused():
    ws = Workspace.allocate(2, 8)
    with pytest.raises(InputError, match="Workspace.write_offsets length 2 != 3"):
        Workspace(ws.sync, ws.write_offsets[:2], ws.seed, ws.block_sum, ws.block_flag)
    with pytest.raises(InputError, match="Workspace.sync must be contiguous"):
        Workspace(torch.zeros(8, dtype=torch.int64)[::2], ws.write_offsets, ws.seed, ws.block_sum, ws.block_flag)


@pytest.mark.parametrize("backend", BACKENDS)
def test_buffers_resized_after_construction_are_refused_before_any_write(backend):
    state = DeviceState(**parts())
    plan = Plan.allocate(4, 1)
    plan.count.fill_(2)
    plan.enable.fill_(1)
    plan.slot[:2] = torch.tensor([99, 98], dtype=torch.int32)
    state.ring.resize_(2, 8)
    before = state.stats.clone()
    with pytest.raises(InputError, match="resized or replaced since the DeviceState was built"):
        verify(state=state, plan=plan, tag=0, backend=backend)
    assert torch.equal(state.stats, before) and state.ring_counter.tolist() == [0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_negative_host_ring_counter_is_refused(backend):
    state = DeviceState(**parts())
    state.ring_counter.fill_(-3)
    with pytest.raises(InputError, match=r"state.ring_counter -3 < 0"):
        verify(state=state, plan=Plan.allocate(4, 1), tag=0, backend=backend)
    assert int(state.stats.sum()) == 0


def test_a_non_state_is_refused():
    with pytest.raises(InputTypeError, match="state must be a DeviceState"):
        verify(state=parts(), plan=Plan.allocate(4, 1), tag=0)


# --- bounded waits -------------------------------------------------------------------------------

def forward_inputs(dev):
    i64 = dict(dtype=torch.int64, device=dev)
    rtt = torch.zeros(4, 1300, dtype=torch.int32, device=dev)
    rtt[1, :3] = torch.tensor([1202, 1203, 1204], dtype=torch.int32)
    return dict(req_pool_indices=torch.tensor([1, 2], **i64), prefix_lens=torch.tensor([3, 0], **i64),
                extend_lens=torch.tensor([1, 1200], **i64), req_to_token=rtt,
                input_ids=torch.arange(5, 1206, **i64), positions=torch.cat([torch.tensor([3], **i64),
                                                                               torch.arange(0, 1200, **i64)]),
                out_cache_loc=torch.arange(1, 1202, **i64))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("stale", [
    dict(sync=[0, 5, 0, 0]),  # a pre-phase count left over from an interrupted launch
    dict(sync=[7, 0, 0, 0]),  # tickets that start past zero: some programs get no role
    dict(sync=[-4, 0, 0, 0]),  # negative tickets
    dict(sync=[0, 0, 0, 2], flag0=3 * 4 + 3),  # a block flag from a later epoch than the counter says
])
def test_a_stale_workspace_raises_the_flag_instead_of_hanging(stale):
    dev = TRITON_DEVICE
    state = DeviceState.allocate(1300, ring_capacity=4096, max_bs=2, max_tokens=2048, device=dev)
    head = state.workspaces[0]
    head.sync.copy_(torch.tensor(stale["sync"]))
    if "flag0" in stale:
        head.block_flag[0] = stale["flag0"]
    t0 = time.perf_counter()
    check_forward(state=state, **forward_inputs(dev), tag=0, stamp=True, backend=Backend.TRITON)
    assert time.perf_counter() - t0 < 120
    if "flag0" in stale:  # a stale epoch is not detectable by the counters: nothing is out of bounds either
        return
    assert int(state.error[0]) & DeviceFlag.WORKSPACE
    # once reset (what the runtime does on the flag), the same launch is clean and complete
    head.reset()
    state.error.zero_()
    clean = DeviceState.allocate(1300, ring_capacity=4096, max_bs=2, max_tokens=2048, device=dev)
    state.records.zero_()
    check_forward(state=state, **forward_inputs(dev), tag=0, stamp=True, backend=Backend.TRITON)
    check_forward(state=clean, **forward_inputs(dev), tag=0, stamp=True, backend=Backend.TORCH)
    assert int(state.error[0]) == 0
    assert torch.equal(state.records.cpu(), clean.records.cpu())
