"""The integration contract refuses misuse at the API edge: every ForwardBatch field is checked
(dtype, shape, device, length) with the field, the expected and the actual value named, before
the canary writes anything; a host move without a host tier names attach_host_tier."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcanary import Canary, CanaryConfig, ForwardBatch, PoolGeometry
from kvcanary.errors import KVCanaryError
from kvcanary.runtime.batch import BatchError


def _fields(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    rtt = torch.zeros(4, 16, dtype=torch.int32)
    rtt[1:3, :6] = (torch.randperm(40, generator=gen)[:12] + 1).view(2, 6).int()
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)
    tokens = torch.randint(1, 100, (2, 6), generator=gen)
    return dict(req_pool_indices=i64([1, 2]), prefix_lens=i64([0, 0]), extend_lens=i64([3, 1]), req_to_token=rtt,
                input_ids=torch.cat([tokens[0, :3], tokens[1, :1]]), positions=i64([0, 1, 2, 0]),
                out_cache_loc=torch.cat([rtt[1, :3], rtt[2, :1]]).long(), truth_ids=tokens.flatten(),
                truth_offsets=i64([0, 6, 12]), request_ids=("a", "b"))


def test_a_well_formed_batch_passes_and_runs():
    canary = Canary(CanaryConfig(), PoolGeometry(num_slots=41, rows=4, max_ctx=16))
    batch = ForwardBatch(**_fields())
    with canary.forward(batch):
        pass
    assert canary.end_step(0).violations == [] and canary.counters()["HEAD"]["stamped"] == 4


BAD = [
    ("req_pool_indices", lambda f: f["req_pool_indices"].int(), r"ForwardBatch.req_pool_indices dtype torch.int32 "
     r"!= torch.int64; convert it with .to\(torch.int64\)"),
    ("req_to_token", lambda f: f["req_to_token"].long(), r"ForwardBatch.req_to_token dtype torch.int64 != torch.int32"),
    ("req_to_token", lambda f: f["req_to_token"].flatten(), r"ForwardBatch.req_to_token has 1 dims \(shape \[64\]\) "
     r"!= 2; expected torch.int32\[rows, max_ctx\]"),
    ("prefix_lens", lambda f: f["prefix_lens"][:1], r"ForwardBatch.prefix_lens length 1 != bs \(2\); one per request"),
    ("extend_lens", lambda f: f["extend_lens"].float(), r"ForwardBatch.extend_lens dtype torch.float32 != torch.int64"),
    ("input_ids", lambda f: [1, 2, 3, 4], r"ForwardBatch.input_ids must be a torch.Tensor \(torch.int64\), got list"),
    ("positions", lambda f: f["positions"][:3], r"ForwardBatch.positions length 3 != len\(input_ids\) \(4\)"),
    ("out_cache_loc", lambda f: f["out_cache_loc"].int(), r"ForwardBatch.out_cache_loc dtype torch.int32 != "
     r"torch.int64"),
    ("out_cache_loc", lambda f: f["out_cache_loc"].view(2, 2), r"ForwardBatch.out_cache_loc has 2 dims"),
    ("truth_offsets", lambda f: f["truth_offsets"][1:], r"ForwardBatch.truth_offsets length 2 != bs\+1 \(3\); build "
     r"it with kvcanary.ops.offsets_from_lengths\(lengths\)"),
    ("truth_offsets", lambda f: None, r"ForwardBatch.truth_ids is given but truth_offsets is None; pass both or "
     r"neither"),
    ("truth_offsets", lambda f: torch.tensor([0, 6, 11]), r"ForwardBatch.truth_offsets must run from 0 to "
     r"len\(truth_ids\) \(12\), got 0..11"),
    ("request_ids", lambda f: ("a",), r"ForwardBatch.request_ids length 1 != bs \(2\)"),
    ("request_ids", lambda f: ["a", "b"], r"ForwardBatch.request_ids must be a tuple"),
    ("slot_lut", lambda f: torch.zeros(41, dtype=torch.int32), r"ForwardBatch.slot_lut dtype torch.int32 != "
     r"torch.int64"),
    ("extend_lens", lambda f: torch.tensor([3, 2]), r"ForwardBatch.extend_lens sums to 5 != len\(input_ids\) \(4\)"),
]


@pytest.mark.parametrize(("field", "bad", "message"), BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_every_field_is_checked_with_the_field_expected_and_actual_named(field, bad, message):
    fields = _fields(seed=len(message))
    fields[field] = bad(fields)
    with pytest.raises(BatchError, match=message):
        ForwardBatch(**fields)


def test_a_tensor_on_another_device_is_named():
    fields = _fields()
    fields["positions"] = fields["positions"].to("meta")
    with pytest.raises(BatchError, match=r"ForwardBatch.positions is on meta != req_to_token's device \(cpu\)"):
        ForwardBatch(**fields)


def test_replace_revalidates_so_a_bad_batch_never_reaches_the_canary():
    batch = ForwardBatch(**_fields())
    with pytest.raises(BatchError, match="slot_lut"):
        dataclasses.replace(batch, slot_lut=torch.zeros(41))


@pytest.mark.parametrize("op", ["offload", "load_back"])
def test_host_moves_without_a_host_tier_name_attach_host_tier(op):
    canary = Canary(CanaryConfig(), PoolGeometry(num_slots=41, rows=4, max_ctx=16))
    slots, rows = torch.tensor([3, 4]), torch.tensor([0, 1])
    before = canary.state.records.clone()
    args = (slots, rows) if op == "offload" else (rows, slots)
    with pytest.raises(KVCanaryError, match=rf"{op}\(\) before attach_host_tier\(\).*canary.attach_host_tier"):
        getattr(canary, op)(*args)
    assert torch.equal(canary.state.records, before) and int(canary.state.stats.sum()) == 0


def test_host_moves_check_their_rows():
    canary = Canary(CanaryConfig(), PoolGeometry(num_slots=41, rows=4, max_ctx=16))
    canary.attach_host_tier(8)
    with pytest.raises(KVCanaryError, match=r"offload device_slots length 2 != host_rows length 1"):
        canary.offload(torch.tensor([3, 4]), torch.tensor([0]))
    with pytest.raises(KVCanaryError, match=r"load_back host_rows must be in \[0, 8\) \(attach_host_tier num_rows\), "
                       r"got values in \[0, 9\]"):
        canary.load_back(torch.tensor([0, 9]), torch.tensor([3, 4]))
    with pytest.raises(KVCanaryError, match=r"offload host_rows must be an int64\[n\] tensor, got torch.float32\[2\]"):
        canary.offload(torch.tensor([3, 4]), torch.tensor([0.0, 1.0]))
    for rows in (0, 2**70):
        with pytest.raises(KVCanaryError, match=rf"attach_host_tier num_rows must be an int in \[1, {2**40}\] "
                           rf"\(host tier rows\) or a HostMirror, got {rows}"):
            canary.attach_host_tier(rows)


def test_row_moves_take_one_slot_per_row():
    """Slots of another shape (a 2-D or a 0-d tensor) are refused by name before anything is read
    or written, on export, land and import alike."""
    canary = Canary(CanaryConfig(), PoolGeometry(num_slots=41, rows=4, max_ctx=16))
    gen = torch.Generator().manual_seed(11)
    canary.state.records.copy_(torch.randint(0, 256, canary.state.records.shape, dtype=torch.uint8, generator=gen))
    rows = canary.export_rows(torch.tensor([3, 7]))
    before = canary.state.records.clone()
    for slots in (torch.tensor([[3, 7]]), torch.tensor(3)):
        shape = tuple(slots.shape)
        with pytest.raises(KVCanaryError, match=rf"export_rows slots must be 1-D, got shape {re.escape(str(shape))}"):
            canary.export_rows(slots)
        for op in (canary.land_rows, canary.import_rows):
            with pytest.raises(KVCanaryError, match=rf"{op.__name__} slots must be 1-D, got shape"):
                op(slots, rows, canary.signature)
    assert torch.equal(canary.state.records, before)


def test_rows_travel_with_their_side_words_and_foreign_rows_are_refused():
    """export_rows gives the record and its source-tag side word; import_rows lands both, and
    refuses rows of another shape (a bare 32-byte record) before writing anything."""
    canary = Canary(CanaryConfig(), PoolGeometry(num_slots=41, rows=4, max_ctx=16))
    gen = torch.Generator().manual_seed(5)
    canary.state.records.copy_(torch.randint(0, 256, canary.state.records.shape, dtype=torch.uint8, generator=gen))
    canary.state.source_tags.copy_(torch.randint(-(2**62), 2**62, (41,), generator=gen))
    rows = canary.export_rows(torch.tensor([3, 7]))
    assert rows.shape == (2, 40) and torch.equal(rows[:, :32], canary.state.records[[3, 7]])
    assert rows[:, 32:].contiguous().view(torch.int64).flatten().tolist() == canary.state.source_tags[[3, 7]].tolist()
    canary.land_rows(torch.tensor([9, 10]), rows, canary.signature)
    assert torch.equal(canary.export_rows(torch.tensor([9, 10])), rows)
    before = canary.state.records.clone()
    with pytest.raises(KVCanaryError, match=r"rows must be uint8\[2, 40\] \(one export_rows row per slot\), got "
                       r"torch.uint8 \(2, 32\)"):
        canary.import_rows(torch.tensor([11, 12]), rows[:, :32], canary.signature)
    assert torch.equal(canary.state.records, before)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_moved_rows_name_a_slot_outside_the_pool_before_anything_is_read_or_written(device):
    """export_rows, land_rows, import_rows, offload and load_back refuse a slot outside the pool,
    naming the call, the argument, the entry and the range, with records, side words and the host
    mirror untouched (on CUDA the gathers would stop the device on it)."""
    canary = Canary(CanaryConfig(), PoolGeometry(num_slots=41, rows=4, max_ctx=16, device=device))
    canary.attach_host_tier(8)
    gen = torch.Generator().manual_seed(9)
    canary.state.records.copy_(torch.randint(0, 256, canary.state.records.shape, dtype=torch.uint8, generator=gen))
    rows = canary.export_rows(torch.tensor([3, 7], device=device))
    state = [canary.state.records.clone(), canary.state.source_tags.clone(), canary.host_rows.clone()]
    slots = lambda *v: torch.tensor(v, device=device)
    calls = [(lambda: canary.export_rows(slots(3, 41)), r"export_rows slots\[1\] = 41 out of range \[0, 41\)"),
             (lambda: canary.land_rows(slots(-1, 7), rows, canary.signature),
              r"land_rows slots\[0\] = -1 out of range \[0, 41\)"),
             (lambda: canary.import_rows(slots(5, 99), rows, canary.signature),
              r"import_rows slots\[1\] = 99 out of range"),
             (lambda: canary.offload(slots(3, 41), torch.tensor([0, 1])),
              r"offload device_slots\[1\] = 41 out of range \[0, 41\)"),
             (lambda: canary.load_back(torch.tensor([0, 1]), slots(2**40, 7)),
              r"load_back device_slots\[0\] = 1099511627776 out of range")]
    for call, message in calls:
        with pytest.raises(KVCanaryError, match=message):
            call()
    after = [canary.state.records, canary.state.source_tags, canary.host_rows]
    assert all(torch.equal(a, b) for a, b in zip(after, state, strict=True))
    for t in (torch.tensor([1.0]), torch.tensor([True]), torch.tensor([1], dtype=torch.uint8)):  # a mask, not slots
        with pytest.raises(KVCanaryError, match=rf"export_rows slots must be a tensor of signed integer slots "
                           rf"\(int64, int32, int16 or int8\), got a {str(t.dtype).removeprefix('torch.')} tensor"):
            canary.export_rows(t.to(device))
    with pytest.raises(KVCanaryError, match=r"verify_landed first_position must be an int or None, got 2.0"):
        canary.verify_landed(slots(3, 4), 2.0)
    # int32 and int16 slots are checked as well: a negative one would index from the end
    for dtype in (torch.int32, torch.int16):
        with pytest.raises(KVCanaryError, match=r"export_rows slots\[0\] = -2 out of range \[0, 41\)"):
            canary.export_rows(torch.tensor([-2, 3], dtype=dtype, device=device))


TENSOR_FIELDS = ["req_pool_indices", "prefix_lens", "extend_lens", "req_to_token", "input_ids", "positions",
                 "out_cache_loc", "truth_ids", "truth_offsets"]


@given(field=st.sampled_from(TENSOR_FIELDS),
       dtype=st.sampled_from([torch.int8, torch.int16, torch.int32, torch.int64, torch.float32, torch.bool]),
       seed=st.integers(0, 2**16))
def test_any_field_with_a_wrong_dtype_is_named(field, dtype, seed):
    fields = _fields(seed)
    expected = fields[field].dtype
    fields[field] = fields[field].to(dtype)
    if dtype == expected:
        ForwardBatch(**fields)
        return
    with pytest.raises(BatchError, match=rf"^ForwardBatch\.{field} dtype {dtype} != {expected}"):
        ForwardBatch(**fields)
