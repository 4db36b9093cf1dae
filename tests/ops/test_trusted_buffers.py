"""Buffers checked once and trusted since: each mutated after it was built (resized, swapped,
restrided at the same address, misaligned, of another geometry) is refused at the next call,
on every backend, with an error naming it, before anything is written; the compiled CPU path's
bound launch, which holds the memory it views, is not reached by such a change at all. And the
raw exceptions and backend disagreements that hostile arguments once caused, each now a clear
error."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from kvcanary.core.record import RECORD_BYTES, LaunchPoint
from kvcanary.errors import InputError, InputTypeError
from kvcanary.ops import (
    Backend,
    BoundCheck,
    BoundVerify,
    DeviceState,
    FingerprintMode,
    KVSource,
    Plan,
    SourceSet,
    _cpu,
    build_plan,
    check_forward,
    check_writes,
    fingerprint,
    gather_expected_tokens,
    mark_writes,
    stamp,
    verify,
)
from kvcanary.ops.backend import BoundForward, batch_arrays, cpu_kernels_usable
from kvcanary.ops.state import STATE_FIELDS

from ._helpers import BACKEND_IDS, BACKENDS, WITH_NUMBA, WITH_NUMBA_IDS

# host-side checks on CPU tensors: the Triton cases run under the interpreter (with a GPU the kernels would be
# compiled for CUDA tensors instead)
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-tensor test of the host-side checks")
GEN = torch.Generator().manual_seed(51)
NUM_SLOTS = 17


def world(dev: str = "cpu") -> dict:
    """A state with workspaces, random records, a filled plan and one KV source (never zeros)."""
    s = DeviceState.allocate(NUM_SLOTS, ring_capacity=8, max_bs=4, max_tokens=8, device=dev)
    s.records.copy_(torch.randint(0, 256, s.records.shape, dtype=torch.uint8, generator=GEN))
    rtt = torch.randint(1, NUM_SLOTS, (3, 5), dtype=torch.int32, generator=GEN)
    rtt[1, 2], rtt[2, 1] = 5, 6  # the write targets
    b = dict(req_pool_indices=torch.tensor([1, 2]), prefix_lens=torch.tensor([2, 1]),
             extend_lens=torch.tensor([1, 1]), req_to_token=rtt)
    plan = Plan.allocate(8, 4)
    build_plan(**b, plan=plan, backend=Backend.TORCH)
    src = KVSource.from_buffer(torch.randint(-(2**31), 2**31 - 1, (NUM_SLOTS, 8), dtype=torch.int32, generator=GEN))
    w = dict(input_ids=torch.tensor([70, 71]), positions=torch.tensor([2, 1]), out_cache_loc=torch.tensor([5, 6]))
    return dict(state=s, plan=plan, src=src, batch=b, writes=w)


def snapshot(w: dict) -> list[torch.Tensor]:
    s = w["state"]
    ts = [s.records, s.ring, s.ring_counter, s.stats, s.error, s.source_tags, w["src"].words]
    ts += [t for ws in s.workspaces for t in ws.tensors()]
    return [t.clone() for t in ts]


def refused(w: dict, call, error, match: str) -> None:
    before = snapshot(w)
    with pytest.raises(error, match=match):
        call()
    # bytes, not values: a buffer retyped to float may hold NaN patterns
    assert all(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
               for a, b in zip(before, snapshot(w), strict=True))


@pytest.mark.parametrize("backend", WITH_NUMBA, ids=WITH_NUMBA_IDS)
@pytest.mark.parametrize("field", ["enable", "overflow"])
def test_a_plan_whose_scalar_buffer_was_resized_is_refused(backend, field):
    w = world()
    getattr(w["plan"], field).resize_(0)
    refused(w, lambda: verify(state=w["state"], plan=w["plan"], tag=1, backend=backend), InputError,
            rf"plan buffers were resized or replaced .*plan\.{field} (int32|int64)\[1\] .* -> .*\[0\]")


@pytest.mark.parametrize("backend", WITH_NUMBA, ids=WITH_NUMBA_IDS)
def test_a_workspace_whose_sync_and_block_sum_were_swapped_is_refused(backend):
    w = world()
    ws = w["state"].workspaces[0]
    sync, block_sum = ws.sync, ws.block_sum
    object.__setattr__(ws, "sync", block_sum)
    object.__setattr__(ws, "block_sum", sync)
    refused(w, lambda: check_forward(state=w["state"], **w["batch"], **w["writes"], tag=1, stamp=True,
                                     backend=backend),
            InputError, r"Workspace buffers were resized or replaced .*sync int64\[4\] .* -> int64\[2\]")


def test_a_workspace_swap_is_refused_by_a_bound_head():
    w = world()
    head = BoundCheck(w["state"], stamp=True)
    ws = w["state"].workspace(LaunchPoint.HEAD)
    object.__setattr__(ws, "seed", ws.write_offsets)
    refused(w, lambda: head(*w["batch"].values(), *w["writes"].values(), tag=1), InputError,
            r"Workspace buffers .*seed int64\[4\] .* -> int64\[5\]")


@pytest.mark.parametrize("backend", WITH_NUMBA, ids=WITH_NUMBA_IDS)
def test_a_ring_restrided_at_the_same_address_is_refused(backend):
    w = world()
    ring = w["state"].ring
    address = ring.data_ptr()
    ring.as_strided_(ring.shape, (1, ring.shape[0]))
    assert ring.data_ptr() == address
    refused(w, lambda: verify(state=w["state"], plan=w["plan"], tag=1, backend=backend), InputError,
            r"state\.ring int64\[8, 8\] strides \(8, 1\) on cpu -> int64\[8, 8\] strides \(1, 8\) on cpu")


def test_records_not_8_byte_aligned_are_refused_at_construction():
    buf = torch.randint(0, 256, (NUM_SLOTS * RECORD_BYTES + 8,), dtype=torch.uint8, generator=GEN)
    off = (-buf.data_ptr()) % 8 + 1
    records = buf[off: off + NUM_SLOTS * RECORD_BYTES].view(NUM_SLOTS, RECORD_BYTES)
    proto = DeviceState.allocate(NUM_SLOTS)
    with pytest.raises(InputError, match=r"state\.records starts 1 bytes past a 8-byte boundary"):
        DeviceState(records, proto.ring.clone(), proto.ring_counter.clone(), proto.stats.clone())


@pytest.mark.parametrize("backend", WITH_NUMBA, ids=WITH_NUMBA_IDS)
def test_records_misaligned_after_construction_are_refused(backend):
    w = world()
    rec = w["state"].records
    buf = torch.empty(rec.numel() + 64, dtype=torch.uint8)
    rec.set_(buf.untyped_storage(), (-buf.data_ptr()) % 64 + 1, rec.shape, rec.stride())
    with pytest.raises(InputError, match=r"state\.records .* moved to another address"):
        verify(state=w["state"], plan=w["plan"], tag=1, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("change", ["num_slots", "page_size", "words"])
def test_a_kv_source_whose_geometry_changed_after_it_was_built_is_refused(backend, change):
    w = world()
    kv = SourceSet.build([w["src"]], FingerprintMode.ALL, NUM_SLOTS, w["state"].device)
    if change == "words":
        w["src"].words.resize_(8)
    else:
        object.__setattr__(w["src"], change, getattr(w["src"], change) * 2)
    want = {"num_slots": "num_slots 17 -> 34", "page_size": "page_size 1 -> 2", "words": r"length \[136\] -> \[8\]"}
    refused(w, lambda: fingerprint(slots=torch.tensor([3, 4]), sources=kv, mode=FingerprintMode.ALL,
                                   state=w["state"], record=True, backend=backend),
            InputError, rf"sources\[0\] changed since it was built \({want[change]}")


def test_a_bound_sweep_refuses_a_source_whose_geometry_changed():
    w = world()
    sweep = BoundVerify(w["state"], w["plan"], [w["src"]], FingerprintMode.PARTIAL)
    sweep(1)
    object.__setattr__(w["src"], "bytes_per_token", 64)
    refused(w, lambda: sweep(1), InputError, r"bound to this BoundVerify changed since it was built "
                                             r"\(bytes_per_token 32 -> 64\)")


@pytest.mark.parametrize("tag", [torch.tensor(1), np.int64(1)])
def test_a_bound_launch_passes_the_kernel_the_tag_as_a_plain_int(tag):
    w, twin = world(), world()
    twin["state"].records.copy_(w["state"].records)
    BoundVerify(w["state"], w["plan"])(tag)
    BoundVerify(twin["state"], w["plan"])(1)
    assert w["state"].stats.tolist() == twin["state"].stats.tolist()
    assert w["state"].stats[1].sum() > 0  # the launch counted under tag 1


@pytest.mark.parametrize("bad", [True, 1.0, "1"])
def test_a_bound_launch_refuses_a_tag_that_is_no_int(bad):
    w = world()
    sweep = BoundVerify(w["state"], w["plan"])
    refused(w, lambda: sweep(bad), InputTypeError, "tag must be an int")


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_mark_writes_type_checks_mode(backend):
    w = world()
    refused(w, lambda: mark_writes(state=w["state"], out_cache_loc=torch.tensor([5]), sources=[w["src"]],
                                   mode="PARTIAL", backend=backend),
            InputTypeError, "mode must be a FingerprintMode, got str 'PARTIAL'")


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("lut", ["empty", "strided"])
def test_an_empty_or_strided_lut_is_refused_by_every_op_that_takes_one(backend, lut):
    w = world()
    table = torch.zeros(0, dtype=torch.int64) if lut == "empty" else torch.arange(2 * NUM_SLOTS)[::2]
    match = "lut is empty" if lut == "empty" else "lut must be contiguous"
    s, plan, wr = w["state"], w["plan"], w["writes"]
    calls = [lambda: stamp(state=s, **wr, req_pool_indices=w["batch"]["req_pool_indices"],
                           prefix_lens=w["batch"]["prefix_lens"], write_offsets=torch.tensor([0, 1, 2]),
                           seed=torch.tensor([-1, -1]), tag=1, lut=table, backend=backend),
             lambda: check_writes(state=s, plan=plan, **wr, req_pool_indices=w["batch"]["req_pool_indices"],
                                  write_offsets=torch.tensor([0, 1, 2]), tag=1, lut=table, backend=backend),
             lambda: mark_writes(state=s, out_cache_loc=wr["out_cache_loc"], sources=[w["src"]], lut=table,
                                 backend=backend),
             lambda: build_plan(**w["batch"], plan=plan, lut=table, backend=backend)]
    for call in calls:
        refused(w, call, InputError, match)


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("shift", [1.0, True, torch.tensor(1)])
def test_gather_refuses_a_shift_that_is_no_int(backend, shift):
    with pytest.raises(InputTypeError, match="shift must be an int"):
        gather_expected_tokens(truth=torch.ones(3, 4, dtype=torch.int32), truth_lens=torch.tensor([4, 4]),
                               req_pool_indices=torch.tensor([1, 2]), prefix_lens=torch.tensor([1, 1]),
                               extend_offsets=torch.tensor([0, 1, 2]), input_ids=torch.tensor([7, 8]), shift=shift,
                               backend=backend)


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_fingerprint_refuses_an_out_that_is_its_slots(backend):
    w = world()
    slots = torch.tensor([3, 4, 5])
    refused(w, lambda: fingerprint(slots=slots, out=slots, sources=[w["src"]], mode=FingerprintMode.ALL,
                                   state=w["state"], record=True, backend=backend),
            InputError, "out shares memory with slots")
    assert slots.tolist() == [3, 4, 5]


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_check_writes_refuses_a_strided_target_list_on_every_backend(backend):
    w = world()
    loc = torch.tensor([5, 0, 6, 0])[::2]
    refused(w, lambda: check_writes(state=w["state"], plan=w["plan"], out_cache_loc=loc,
                                    input_ids=w["writes"]["input_ids"], positions=w["writes"]["positions"],
                                    req_pool_indices=w["batch"]["req_pool_indices"],
                                    write_offsets=torch.tensor([0, 1, 2]), tag=1, backend=backend),
            InputError, "out_cache_loc must be contiguous")


@pytest.mark.parametrize("backend", WITH_NUMBA, ids=WITH_NUMBA_IDS)
@pytest.mark.parametrize("sources", [None, 3, "src"])
def test_sources_that_are_no_list_are_refused(backend, sources):
    w = world()
    refused(w, lambda: check_forward(state=w["state"], **w["batch"], **w["writes"], tag=1, stamp=False,
                                     sources=sources, mode=FingerprintMode.ALL, backend=backend),
            InputTypeError, "sources must be a list of KVSource or a SourceSet")


def test_a_bound_launch_takes_writes_through_torch_and_refuses_a_retyped_buffer():
    w = world()
    sweep = BoundVerify(w["state"], w["plan"], [w["src"]], FingerprintMode.PARTIAL)
    w["state"].ring.fill_(-3)  # a write through torch bumps the version: the layout is the one bound
    w["src"].words.add_(1)
    sweep(1)
    assert w["state"].stats[1].sum() > 0
    ring = w["state"].ring
    ring.data = ring.view(torch.float64)  # the same address and version counter, another dtype
    refused(w, lambda: sweep(1), InputError, r"state\.ring int64\[8, 8\] .* -> float64\[8, 8\]")


def test_two_sources_whose_words_were_swapped_are_refused_by_a_bound_launch():
    w = world()
    other = KVSource.from_buffer(torch.randint(-(2**31), 2**31 - 1, (NUM_SLOTS, 8), dtype=torch.int32, generator=GEN),
                                 layer=1)
    sweep = BoundVerify(w["state"], w["plan"], [w["src"], other], FingerprintMode.PARTIAL)
    sweep(1)
    a, b = w["src"].words, other.words
    object.__setattr__(w["src"], "words", b)  # each keeps its geometry and reads the other's buffer
    object.__setattr__(other, "words", a)
    refused(w, lambda: sweep(1), InputError, r"sources\[0\] bound to this BoundVerify changed since it was built "
                                             r"\(moved to another address\)")


def test_the_pool_buffer_written_leaves_the_words_as_bound_and_a_grown_buffer_is_refused():
    buf = torch.randint(-(2**31), 2**31 - 1, (NUM_SLOTS, 8), dtype=torch.int32, generator=GEN)
    w = world()
    src = KVSource.from_buffer(buf)
    w["src"] = src
    sweep = BoundVerify(w["state"], w["plan"], [src], FingerprintMode.PARTIAL)
    version = src.words._version
    buf[3].add_(1)  # the model's write, through its own buffer: the same memory, the words' version unmoved
    assert src.words.view(NUM_SLOTS, 8)[3].equal(buf[3]) and src.words._version == version
    sweep(1)
    buf.resize_(NUM_SLOTS * 64, 8)  # the storage grows: its memory moves under the words too
    refused(w, lambda: sweep(1), InputError, r"sources\[0\] bound to this BoundVerify changed since it was built "
                                             r"\(moved to another address\)")


@pytest.mark.skipif(not cpu_kernels_usable(), reason="the compiled CPU kernels do not serve here")
def test_the_compiled_launch_holds_the_memory_it_was_bound_to_and_no_later_change_reaches_it():
    w = world()
    s, src = w["state"], w["src"]
    kv = SourceSet.build([src], FingerprintMode.PARTIAL, NUM_SLOTS, s.device)
    truth = torch.randint(1, 50_000, (3, 5), dtype=torch.int32, generator=GEN)
    launch = BoundForward(s, kv.list(), kv.meta, truth, torch.zeros(3, dtype=torch.int64), 0, 8)
    bound = [getattr(s, f) for f in STATE_FIELDS] + [src.words]
    refs = [StorageWeakRef(t.untyped_storage()) for t in bound]
    # the counter block's three buffers are views of one tensor, which holds their storage itself
    own = [i for i, t in enumerate(bound) if t._base is None]
    before = [t.clone() for t in bound]
    with pytest.raises(RuntimeError, match="not resizable"):  # the memory it views cannot move
        src.words.untyped_storage().resize_(src.words.untyped_storage().nbytes() * 4)
    for t in bound:  # every buffer it views: the tensor now over a copy elsewhere, its old storage let go
        t.data = t.clone()
    del bound
    _cpu._state_views.clear()  # the numpy views the ops keep: the launch's own alone are left
    _cpu._views.clear()
    gc.collect()
    assert not any(r.expired() for r in refs)  # the launch's views keep the memory they view alive
    moved = [getattr(s, f).clone() for f in STATE_FIELDS] + [src.words.clone()]
    b, wr = w["batch"], w["writes"]
    arrays = batch_arrays(b["req_pool_indices"], b["prefix_lens"], b["extend_lens"], b["req_to_token"],
                          wr["input_ids"], wr["positions"], wr["out_cache_loc"], None)
    assert launch.check(arrays, None, 1, True, False)
    # HEAD wrote the records of its two write targets and counted its launch in the memory it was bound to
    records, stats = launch.state_arrays[0].view(np.uint8), launch.state_arrays[3]
    written = [i for i in range(NUM_SLOTS) if not np.array_equal(records[i], before[0][i].numpy())]
    assert written == [5, 6] and stats[1].sum() > before[3][1].sum()
    # and nothing in the tensors' new buffers
    assert all(torch.equal(a, b) for a, b in zip(moved, [getattr(s, f) for f in STATE_FIELDS] + [src.words],
                                                 strict=True))
    del launch, arrays, records, stats
    gc.collect()
    assert len(own) == 4 and all(refs[i].expired() for i in own)  # nothing else held them: the launch did
