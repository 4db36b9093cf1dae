from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcanary.core.record import new_ring, new_stats
from kvcanary.ops import plan as plan_mod
from kvcanary.ops._common import Backend
from kvcanary.ops.plan import Plan, build_plan
from kvcanary.ops.verify import verify

from . import reference as ref
from ._compare import assert_same
from ._helpers import (
    BACKEND_IDS,
    BACKENDS,
    SEEDS,
    device_for,
    on_device,
    plan_lists,
    random_plan,
    run_op,
    strided,
    token_ids,
    wide,
    with_state,
)


def make_inputs(gen: torch.Generator, bs: int, rows: int, max_ctx: int, num_slots: int, with_truth: bool,
                with_lut: bool) -> dict:
    """A random forward: rows may repeat, row 0 is padding; page-table entries are mostly valid
    slots with some 0, negative and out-of-pool ones; the truth table is narrower or wider than max_ctx."""
    rpi = torch.randint(0, rows, (bs,), generator=gen)
    prefix_lens = torch.randint(0, max_ctx + 1, (bs,), generator=gen)
    extend_lens = (torch.rand(bs, generator=gen) * (max_ctx - prefix_lens + 1)).long()
    rtt = torch.randint(1, num_slots, (rows, max_ctx), generator=gen)
    odd = torch.rand(rows, max_ctx, generator=gen)
    rtt = torch.where(odd < 0.05, 0, torch.where(odd < 0.08, num_slots + 3, torch.where(odd < 0.1, -2, rtt)))
    inputs = dict(req_pool_indices=rpi, prefix_lens=prefix_lens, extend_lens=extend_lens,
                  req_to_token=rtt.to(torch.int32))
    if with_truth:
        width = int(torch.randint(1, max_ctx + 3, (1,), generator=gen))
        inputs["truth"] = token_ids(gen, rows * width, -(2**31), 2**31 - 1).to(torch.int32).reshape(rows, width)
        inputs["truth_lens"] = torch.randint(0, max_ctx + 2, (bs,), generator=gen)
    if with_lut:
        lut = torch.randint(0, num_slots // 2 + 2, (num_slots + 1,), generator=gen)
        inputs["lut"] = torch.where(torch.rand(num_slots + 1, generator=gen) < 0.2, 0, lut)
    return inputs


def expected_plan(inputs: dict, plan: Plan, window: int) -> dict[str, list[int]]:
    lists = {k: v.tolist() for k, v in inputs.items()}
    truth = inputs.get("truth")
    return ref.build_plan(lists["req_pool_indices"], lists["prefix_lens"], lists["extend_lens"],
                          lists["req_to_token"], inputs["req_to_token"].shape[1], plan_lists(plan),
                          truth=lists.get("truth"), truth_width=0 if truth is None else truth.shape[1],
                          truth_lens=lists.get("truth_lens"), lut=lists.get("lut"), window=window)


def check_all_backends(inputs: dict, plan: Plan, window: int = 0) -> dict[str, list[int]]:
    want = expected_plan(inputs, plan, window)
    for backend in BACKENDS:
        args, got = run_op(build_plan, backend, **inputs, plan=plan, window=window)
        assert got is args["plan"]
        for name in ref.PLAN_FIELDS:
            assert_same(f"plan.{name} [{backend.value}]", getattr(got, name), want[name])
    return want


@given(seed=SEEDS, bs=st.integers(0, 8), max_ctx=st.integers(1, 24), window=st.sampled_from([0, 0, 1, 5]),
       with_truth=st.booleans(), with_lut=st.booleans(), spare=st.integers(-20, 40))
def test_matches_reference(seed, bs, max_ctx, window, with_truth, with_lut, spare):
    gen = torch.Generator().manual_seed(seed)
    inputs = make_inputs(gen, bs, rows=5, max_ctx=max_ctx, num_slots=60, with_truth=with_truth, with_lut=with_lut)
    need = int(expected_plan(inputs, random_plan(gen, 1, 8), window)["count"][0])
    capacity = max(need + spare, 1)  # spare < 0: overflow
    check_all_backends(inputs, random_plan(gen, capacity, max_bs=max(bs, 1) + int(torch.randint(0, 3, (1,)))), window)


def test_empty_batch():
    gen = torch.Generator().manual_seed(1)
    inputs = make_inputs(gen, 0, rows=3, max_ctx=5, num_slots=10, with_truth=True, with_lut=False)
    want = check_all_backends(inputs, random_plan(gen, 4, 2))
    assert want["count"] == [0] and want["enable"] == [1] and want["verify_offsets"][0] == 0


def test_padding_rows_read_nothing_and_seed_minus_one():
    rtt = torch.arange(1, 13, dtype=torch.int32).reshape(3, 4)
    inputs = dict(req_pool_indices=torch.tensor([0, 2, 0, 1]), prefix_lens=torch.tensor([3, 2, 4, 0]),
                  extend_lens=torch.tensor([1, 2, 0, 4]), req_to_token=rtt)
    want = check_all_backends(inputs, random_plan(torch.Generator().manual_seed(2), 6, 4))
    assert want["count"] == [2] and want["slot"][:2] == [9, 10] and want["pred"][:2] == [-1, 9]
    assert want["verify_offsets"][:5] == [0, 0, 2, 2, 2] and want["write_offsets"][:5] == [0, 1, 3, 3, 7]
    assert want["seed"][:4] == [-1, 10, -1, -1]


def test_one_long_prefix_spans_many_blocks():
    gen = torch.Generator().manual_seed(3)
    inputs = make_inputs(gen, 4, rows=4, max_ctx=2600, num_slots=5000, with_truth=True, with_lut=False)
    inputs["req_pool_indices"] = torch.tensor([1, 2, 0, 3])
    inputs["prefix_lens"] = torch.tensor([2500, 3, 100, 0])
    inputs["extend_lens"] = torch.tensor([1, 2, 1, 7])
    check_all_backends(inputs, random_plan(gen, 2600, 4))
    check_all_backends(inputs, random_plan(gen, 2600, 4), window=1500)


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_overflow_disables_verify_and_counts(backend):
    """count > capacity: enable 0, overflow += 1 per step; verify then checks nothing but counts one launch."""
    gen = torch.Generator().manual_seed(4)
    inputs = make_inputs(gen, 3, rows=4, max_ctx=8, num_slots=20, with_truth=False, with_lut=False)
    inputs["req_pool_indices"], inputs["prefix_lens"] = torch.tensor([1, 2, 3]), torch.tensor([4, 4, 4])
    inputs["extend_lens"] = torch.tensor([1, 1, 1])
    plan = Plan.allocate(capacity=10, max_bs=3)
    args, plan = run_op(build_plan, backend, **inputs, plan=plan)
    assert (plan.count.tolist(), plan.enable.tolist(), plan.overflow.tolist()) == ([12], [0], [1])
    # the entries that fit are still filled (entries >= min(count, cap) are left alone)
    assert plan.position.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    build_plan(**{k: v for k, v in args.items() if k != "plan"}, plan=plan, backend=backend)
    assert (plan.count.tolist(), plan.enable.tolist(), plan.overflow.tolist()) == ([12], [0], [2])
    # a canary full of garbage would fail every check, but an overflowed plan checks nothing
    canary = torch.randint(0, 256, (20, 32), dtype=torch.uint8, generator=gen).to(plan.slot.device)
    ring, counter = new_ring(8, device=plan.slot.device)
    stats = new_stats(device=plan.slot.device)
    with_state(verify, canary=canary, plan=plan, ring=ring, ring_counter=counter, stats=stats, tag=4, backend=backend)
    assert counter.tolist() == [0] and bool((ring == -1).all())
    assert stats[4].tolist() == [1, 0, 0] and int(stats.sum()) == 1
    # the next step fits again: enable returns to 1, the overflow count stays
    small = {**{k: v for k, v in args.items() if k != "plan"},
             "prefix_lens": torch.tensor([4, 4, 0], device=plan.slot.device)}
    build_plan(**small, plan=plan, backend=backend)
    assert (plan.count.tolist(), plan.enable.tolist(), plan.overflow.tolist()) == ([8], [1], [2])


# --- validation ------------------------------------------------------------------------------

def valid_inputs() -> dict:
    return dict(req_pool_indices=torch.tensor([1, 0, 2]), prefix_lens=torch.tensor([2, 0, 3]),
                extend_lens=torch.tensor([1, 1, 2]), req_to_token=torch.ones(4, 6, dtype=torch.int32),
                plan=Plan.allocate(16, 4))


TRUTH = dict(truth=torch.zeros(4, 6, dtype=torch.int32), truth_lens=torch.tensor([1, 1, 1]))


@pytest.mark.parametrize("change, exc, fragment", [
    (dict(req_pool_indices=torch.tensor([1, 0, 2], dtype=torch.int32)), TypeError,
     "req_pool_indices dtype int32 != int64"),
    (dict(prefix_lens=torch.tensor([2, 0, 3], dtype=torch.int32)), TypeError, "prefix_lens dtype int32 != int64"),
    (dict(extend_lens=torch.tensor([1.0, 1.0, 2.0])), TypeError, "extend_lens dtype float32 != int64"),
    (dict(req_to_token=torch.ones(4, 6, dtype=torch.int64)), TypeError, "req_to_token dtype int64 != int32"),
    (dict(plan=object()), TypeError, "plan must be a Plan (Plan.allocate(...)), got object"),
    (dict(truth=TRUTH["truth"]), ValueError, "truth and truth_lens go together"),
    (dict(truth_lens=TRUTH["truth_lens"]), ValueError, "truth and truth_lens go together"),
    ({**TRUTH, "truth": torch.zeros(4, 6, dtype=torch.int64)}, TypeError, "truth dtype int64 != int32"),
    ({**TRUTH, "truth_lens": torch.tensor([1, 1, 1], dtype=torch.int32)}, TypeError,
     "truth_lens dtype int32 != int64"),
    (dict(lut=torch.zeros(5, dtype=torch.int32)), TypeError, "lut dtype int32 != int64"),
    (dict(req_to_token=torch.ones(24, dtype=torch.int32)), ValueError, "req_to_token must be 2-D"),
    (dict(lut=torch.zeros(5, 1, dtype=torch.int64)), ValueError, "lut must be 1-D"),
    (dict(window=-1), ValueError, "window -1 < 0; use 0 for full attention"),
    (dict(prefix_lens=torch.tensor([2, 0])), ValueError, "prefix_lens length 2 != bs (3)"),
    (dict(extend_lens=torch.tensor([1, 1, 2, 0])), ValueError, "extend_lens length 4 != bs (3)"),
    ({**TRUTH, "truth_lens": torch.tensor([1])}, ValueError, "truth_lens length 1 != bs (3)"),
    (dict(plan=Plan.allocate(16, 2)), ValueError, "batch size 3 > plan max_bs (2)"),
    (dict(req_pool_indices=torch.tensor([1, 4, 2])), ValueError,
     "req_pool_indices[1] out of range (req_pool_indices 4, prefix_lens 0, extend_lens 1; rows 4, max_ctx 6)"),
    (dict(req_pool_indices=torch.tensor([1, -1, 2])), ValueError, "req_pool_indices[1] out of range"),
    (dict(prefix_lens=torch.tensor([2, 0, -3])), ValueError, "prefix_lens[2] out of range"),
    (dict(extend_lens=torch.tensor([-1, 1, 2])), ValueError, "extend_lens[0] out of range"),
    (dict(extend_lens=torch.tensor([1, 1, 4])), ValueError,
     "prefix_lens + extend_lens[2] out of range (req_pool_indices 2, prefix_lens 3, extend_lens 4; rows 4, max_ctx 6)"),
    ({**TRUTH, "truth": torch.zeros(3, 6, dtype=torch.int32)}, ValueError, "truth rows 3 != req_to_token rows (4)"),
    (dict(lut=torch.zeros(5, dtype=torch.int64, device="meta")), ValueError, "lut is on the meta device"),
])
def test_validation_errors(change, exc, fragment):
    for backend in BACKENDS:
        with pytest.raises(exc) as info:
            build_plan(**{**valid_inputs(), **change}, backend=backend)
        assert fragment in str(info.value)


def test_allocate_errors_and_shapes():
    plan = Plan.allocate(7, 3)
    assert (plan.capacity, plan.max_bs) == (7, 3)
    assert [getattr(plan, n).dtype for n in ref.PLAN_FIELDS] == [torch.int32] * 4 + [torch.int64, torch.int32] + \
        [torch.int64] * 4 + [torch.int32] * 2
    with pytest.raises(ValueError, match="plan capacity 0 < 1"):
        Plan.allocate(0, 3)
    with pytest.raises(ValueError, match="plan max_bs 0 < 1"):
        Plan.allocate(4, 0)


# --- device-side safety ------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_device_values_are_clamped(monkeypatch, backend):
    """Device tensors skip the value checks: rows outside the table read nothing, prefixes are
    clamped to [0, max_ctx], negative extends count as 0; the result is the reference's."""
    monkeypatch.setattr(plan_mod, "is_host", lambda t: False)
    gen = torch.Generator().manual_seed(5)
    inputs = make_inputs(gen, 6, rows=4, max_ctx=6, num_slots=30, with_truth=True, with_lut=False)
    inputs["req_pool_indices"] = torch.tensor([1, 4, -1, 2, 3, 2**40])
    inputs["prefix_lens"] = torch.tensor([9, 2, 2, -4, 6, 1])
    inputs["extend_lens"] = torch.tensor([-2, 1, 5, 1, 7, 1])
    check_all_backends(inputs, random_plan(gen, 40, 6))


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_device_truth_with_fewer_rows_is_rejected(monkeypatch, backend):
    """The truth table is indexed by page-table row: a shorter one must be refused from its shape,
    which needs no device sync, rather than read out of bounds."""
    monkeypatch.setattr(plan_mod, "is_host", lambda t: False)
    with pytest.raises(ValueError, match=r"truth rows 3 != req_to_token rows \(4\)"):
        build_plan(**{**valid_inputs(), "req_pool_indices": torch.tensor([1, 0, 3])},
                   truth=torch.zeros(3, 6, dtype=torch.int32), truth_lens=torch.tensor([6, 6, 6]), backend=backend)


@pytest.mark.parametrize("name", ["req_pool_indices", "prefix_lens", "extend_lens", "truth_lens", "lut",
                                  "req_to_token", "truth"])
def test_strided_inputs_are_refused_or_honoured(name):
    """A non-contiguous view (2-D tables: a column slice, unit column stride): the torch path reads
    it as it is; the kernels must either refuse it or give the same plan."""
    gen = torch.Generator().manual_seed(8)
    inputs = make_inputs(gen, 4, rows=5, max_ctx=7, num_slots=30, with_truth=True, with_lut=True)
    plan = random_plan(gen, 30, 5)
    want = expected_plan(inputs, plan, 0)
    for backend in BACKENDS:
        args = {k: on_device(v, device_for(backend)) for k, v in inputs.items()}
        args[name] = wide(args[name]) if args[name].dim() == 2 else strided(args[name])
        try:
            got = build_plan(**args, plan=on_device(plan, device_for(backend)), backend=backend)
        except ValueError as e:
            assert "contiguous" in str(e) or "stride" in str(e), (backend, e)  # refused on every backend alike
            continue
        for field in ref.PLAN_FIELDS:
            assert_same(f"plan.{field} [{backend.value}]", getattr(got, field), want[field])


def test_triton_layout_errors():
    inputs = make_inputs(torch.Generator().manual_seed(9), 2, rows=4, max_ctx=6, num_slots=30, with_truth=True,
                         with_lut=False)
    for name in ("req_to_token", "truth"):
        t = inputs[name]
        transposed = t.t().contiguous().t()
        for backend in BACKENDS:
            with pytest.raises(ValueError, match=f"{name} must have unit column stride"):
                build_plan(**{**inputs, name: transposed}, plan=Plan.allocate(30, 2), backend=backend)


def test_explicit_torch_backend_is_the_cpu_default():
    inputs = make_inputs(torch.Generator().manual_seed(6), 3, rows=4, max_ctx=6, num_slots=30, with_truth=True,
                         with_lut=True)
    a = build_plan(**inputs, plan=Plan.allocate(30, 3))
    b = build_plan(**inputs, plan=Plan.allocate(30, 3), backend=Backend.TORCH)
    for name in ref.PLAN_FIELDS:
        assert_same(name, getattr(a, name), getattr(b, name))


def test_entry_columns_are_the_six_entry_buffers_back_to_back_and_none_for_buffers_built_apart():
    plan = Plan.allocate(capacity=7, max_bs=2)
    block = plan.entry_columns()
    assert block is not None and block.shape == (6, 7) and block.dtype == torch.int32
    assert block[:, 0].tolist() == [0, -1, 0, -1, 0, 0]  # allocate's initial values, column by column
    gen = torch.Generator().manual_seed(8)
    values = torch.randint(-100, 100, (6, 5), dtype=torch.int32, generator=gen)
    block[:, :5] = values
    for i, buf in enumerate((plan.slot, plan.pred, plan.position, plan.token, plan.entry, plan.row)):
        assert buf[:5].tolist() == values[i].tolist()
    apart = Plan(**{f.name: getattr(plan, f.name).clone() for f in dataclasses.fields(plan)})
    assert apart.entry_columns() is None
