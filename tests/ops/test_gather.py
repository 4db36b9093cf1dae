from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcanary.ops import gather as gather_mod
from kvcanary.ops._common import Backend
from kvcanary.ops.gather import gather_expected_tokens
from kvcanary.ops.scatter import offsets_from_lengths

from . import reference as ref
from ._compare import assert_same
from ._helpers import (
    BACKEND_IDS,
    BACKENDS,
    INT32_MAX,
    INT32_MIN,
    SEEDS,
    device_for,
    on_device,
    run_op,
    strided,
    token_ids,
    wide,
)


def make_inputs(gen: torch.Generator, bs: int, width: int, max_extend: int, extra_rows: int = 2) -> dict:
    """Random requests over distinct rows (some padding on row 0), prefixes and truth lengths that
    land both inside and outside the truth, and input ids that mostly match it."""
    rows = bs + extra_rows + 1
    rpi = torch.randperm(rows, generator=gen)[:bs]
    rpi[torch.rand(bs, generator=gen) < 0.2] = 0
    prefix_lens = torch.randint(0, width + 2, (bs,), generator=gen)
    extend_lens = torch.randint(0, max_extend + 1, (bs,), generator=gen)
    truth_lens = torch.randint(0, width + 3, (bs,), generator=gen)
    offsets = offsets_from_lengths(extend_lens)
    truth = token_ids(gen, rows * width, INT32_MIN, INT32_MAX).to(torch.int32).reshape(rows, width)
    input_ids = token_ids(gen, int(offsets[-1]))
    return dict(truth=truth, truth_lens=truth_lens, req_pool_indices=rpi, prefix_lens=prefix_lens,
                extend_offsets=offsets, input_ids=input_ids)


def expected_out(inputs: dict, shift: int) -> list[int]:
    lists = {k: v.tolist() for k, v in inputs.items()}
    return ref.gather_expected_tokens(lists["truth"], inputs["truth"].shape[1], lists["truth_lens"],
                                      lists["req_pool_indices"], lists["prefix_lens"], lists["extend_offsets"],
                                      lists["input_ids"], shift)


def check_all_backends(inputs: dict, shift: int = 0) -> None:
    want = expected_out(inputs, shift)
    for backend in BACKENDS:
        _, out = run_op(gather_expected_tokens, backend, **inputs, shift=shift)
        assert out.dtype == torch.int64
        assert_same(f"expected tokens [{backend.value}, shift {shift}]", out, want)


@given(seed=SEEDS, bs=st.integers(0, 10), width=st.integers(1, 12), shift=st.sampled_from([0, 1]))
def test_matches_reference(seed, bs, width, shift):
    gen = torch.Generator().manual_seed(seed)
    check_all_backends(make_inputs(gen, bs, width, max_extend=5), shift)


def test_empty_batch():
    inputs = dict(truth=torch.ones(2, 3, dtype=torch.int32), truth_lens=torch.zeros(0, dtype=torch.int64),
                  req_pool_indices=torch.zeros(0, dtype=torch.int64), prefix_lens=torch.zeros(0, dtype=torch.int64),
                  extend_offsets=torch.zeros(1, dtype=torch.int64), input_ids=torch.zeros(0, dtype=torch.int64))
    check_all_backends(inputs)


def test_truth_edges_padding_and_shift():
    truth = torch.tensor([[900, 901, 902, 903], [10, 11, 12, 13], [20, 21, 22, 23]], dtype=torch.int32)
    inputs = dict(truth=truth, truth_lens=torch.tensor([3, 9, 4]), req_pool_indices=torch.tensor([1, 0, 2]),
                  prefix_lens=torch.tensor([1, 0, 2]), extend_offsets=torch.tensor([0, 3, 4, 7]),
                  input_ids=torch.tensor([-1, -2, -3, -4, -5, -6, -7]))
    check_all_backends(inputs, 0)
    check_all_backends(inputs, 1)
    _, out = run_op(gather_expected_tokens, Backend.TORCH, **inputs)
    # row 1: p = 1, 2 known (truth_len 3), p = 3 not; padding row 0 never; row 2: p = 2, 3 known, p = 4 past width
    assert out.tolist() == [11, 12, -3, -4, 22, 23, -7]
    _, out = run_op(gather_expected_tokens, Backend.TORCH, **inputs, shift=1)
    assert out.tolist() == [12, -2, -3, -4, 23, -6, -7]


def test_out_is_filled_in_place():
    inputs = make_inputs(torch.Generator().manual_seed(3), bs=4, width=6, max_extend=4)
    for backend in BACKENDS:
        out = torch.full_like(inputs["input_ids"], -99, device=device_for(backend))
        args, got = run_op(gather_expected_tokens, backend, **inputs, out=out)
        assert got is args["out"]
        assert_same("out", got, expected_out(inputs, 0))


def test_one_long_request_spans_many_blocks():
    gen = torch.Generator().manual_seed(21)
    extend = torch.tensor([2, 2500, 1, 0])
    rows, width = 5, 2600
    inputs = dict(truth=torch.randint(0, 50_000, (rows, width), dtype=torch.int32, generator=gen),
                  truth_lens=torch.tensor([2600, 2400, 1, 0]), req_pool_indices=torch.tensor([3, 1, 0, 4]),
                  prefix_lens=torch.tensor([7, 60, 0, 3]), extend_offsets=offsets_from_lengths(extend),
                  input_ids=token_ids(gen, int(extend.sum())))
    check_all_backends(inputs)


def test_more_than_4096_requests():
    gen = torch.Generator().manual_seed(22)
    check_all_backends(make_inputs(gen, bs=5000, width=6, max_extend=3), shift=1)


# --- validation ------------------------------------------------------------------------------

def valid_inputs() -> dict:
    return dict(truth=torch.zeros(4, 8, dtype=torch.int32), truth_lens=torch.tensor([8, 8, 8]),
                req_pool_indices=torch.tensor([1, 0, 2]), prefix_lens=torch.tensor([0, 1, 2]),
                extend_offsets=torch.tensor([0, 3, 3, 7]), input_ids=torch.arange(7))


@pytest.mark.parametrize("change, exc, fragment", [
    (dict(truth=torch.zeros(4, 8, dtype=torch.int64)), TypeError, "truth dtype int64 != int32"),
    (dict(truth_lens=torch.tensor([8, 8, 8], dtype=torch.int32)), TypeError, "truth_lens dtype int32 != int64"),
    (dict(req_pool_indices=torch.tensor([1, 0, 2], dtype=torch.int32)), TypeError,
     "req_pool_indices dtype int32 != int64"),
    (dict(prefix_lens=torch.tensor([0.0, 1.0, 2.0])), TypeError, "prefix_lens dtype float32 != int64"),
    (dict(extend_offsets=torch.tensor([0, 3, 3, 7], dtype=torch.int16)), TypeError,
     "extend_offsets dtype int16 != int64"),
    (dict(input_ids=torch.arange(7, dtype=torch.int32)), TypeError, "input_ids dtype int32 != int64"),
    (dict(out=torch.zeros(7, dtype=torch.int32)), TypeError, "out dtype int32 != int64"),
    (dict(truth=torch.zeros(32, dtype=torch.int32)), ValueError, "truth must be 2-D, got shape (32,)"),
    (dict(prefix_lens=torch.zeros(1, 3, dtype=torch.int64)), ValueError, "prefix_lens must be 1-D"),
    (dict(truth_lens=torch.tensor([8, 8])), ValueError, "truth_lens length 2 != bs (3)"),
    (dict(prefix_lens=torch.tensor([0, 1, 2, 3])), ValueError, "prefix_lens length 4 != bs (3)"),
    (dict(out=torch.zeros(6, dtype=torch.int64)), ValueError, "out length 6 != len(input_ids) (7)"),
    (dict(extend_offsets=torch.tensor([0, 3, 7])), ValueError, "extend_offsets length 3 != bs+1 (4)"),
    (dict(extend_offsets=torch.tensor([1, 3, 3, 7])), ValueError, "extend_offsets[0] 1 != 0"),
    (dict(extend_offsets=torch.tensor([0, 3, 2, 7])), ValueError, "extend_offsets decrease at index 2: 2 < 3"),
    (dict(extend_offsets=torch.tensor([0, 3, 3, 6])), ValueError, "extend_offsets[-1] 6 != number of tokens (7)"),
    (dict(shift=2), ValueError, "shift 2 not in (0, 1)"),
    (dict(shift=-1), ValueError, "shift -1 not in (0, 1)"),
    (dict(req_pool_indices=torch.tensor([1, 4, 2])), ValueError, "req_pool_indices[1] = 4 out of range [0, 4)"),
    (dict(req_pool_indices=torch.tensor([-1, 0, 2])), ValueError, "req_pool_indices[0] = -1 out of range [0, 4)"),
    (dict(input_ids=[0, 1]), TypeError, "input_ids must be a torch.Tensor, got list"),
    (dict(truth=torch.zeros(4, 8, dtype=torch.int32, device="meta")), ValueError,
     "truth is on the meta device"),
])
def test_validation_errors(change, exc, fragment):
    for backend in BACKENDS:
        with pytest.raises(exc) as info:
            gather_expected_tokens(**{**valid_inputs(), **change}, backend=backend)
        assert fragment in str(info.value)


@pytest.mark.parametrize("name", ["truth_lens", "req_pool_indices", "prefix_lens", "extend_offsets", "input_ids",
                                  "out", "truth"])
def test_strided_inputs_are_refused_or_honoured(name):
    """A non-contiguous view (for truth: a column slice, unit column stride): the torch path reads it
    as it is; the kernel must either refuse it or give the same result."""
    inputs = make_inputs(torch.Generator().manual_seed(8), bs=5, width=6, max_extend=4)
    inputs["out"] = torch.full_like(inputs["input_ids"], -9)
    want = expected_out(inputs, 0)
    for backend in BACKENDS:
        args = {k: on_device(v, device_for(backend)) for k, v in inputs.items()}
        args[name] = wide(args[name]) if name == "truth" else strided(args[name])
        try:
            gather_expected_tokens(**args, backend=backend)
        except ValueError as e:
            assert "contiguous" in str(e), (backend, e)  # refused on every backend alike
            continue
        assert_same(f"out [{backend.value}]", args["out"], want)


def test_triton_layout_errors():
    truth_t = torch.zeros(8, 4, dtype=torch.int32).t()
    with pytest.raises(ValueError, match="truth must have unit column stride"):
        gather_expected_tokens(**{**valid_inputs(), "truth": truth_t}, backend=Backend.TRITON)


# --- device-side safety ------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("offsets, rows, prefix", [
    ([0, 3, 3, 7], [1, 9, -3], [0, 1, 2]),          # rows out of range: no truth
    ([0, 3, 3, 7], [1, 0, 2], [-5, 2**40, 6]),      # positions before 0 / past the width
    ([5, 3, 3, 7], [1, 0, 2], [0, 1, 2]),           # offsets that start late and decrease
    ([0, 3, 3, 99], [1, 0, 2], [0, 1, 2]),          # offsets past the token count
    ([0, -2**40, 3, 7], [1, 3, 2], [0, 1, 2]),
])
def test_device_values_stay_in_bounds(monkeypatch, backend, offsets, rows, prefix):
    """Device tensors skip the value checks: every token still gets its truth or its own id."""
    monkeypatch.setattr(gather_mod, "is_host", lambda t: False)
    truth = torch.arange(100, 132, dtype=torch.int32).reshape(4, 8)
    input_ids = torch.arange(-7, 0)
    inputs = dict(truth=truth, truth_lens=torch.tensor([8, 8, 8]), req_pool_indices=torch.tensor(rows),
                  prefix_lens=torch.tensor(prefix), extend_offsets=torch.tensor(offsets), input_ids=input_ids)
    _, out = run_op(gather_expected_tokens, backend, **inputs)
    allowed = set(truth[1:].flatten().tolist())
    for t, v in enumerate(out.tolist()):
        assert v == input_ids[t] or v in allowed, (t, v)
    if offsets == [0, 3, 3, 7]:  # good offsets: exactly the reference, bad rows and positions give the input id
        lists = {k: v.tolist() for k, v in inputs.items()}
        lists["req_pool_indices"] = [r if 0 <= r < 4 else 0 for r in rows]
        want = ref.gather_expected_tokens(lists["truth"], 8, lists["truth_lens"], lists["req_pool_indices"],
                                          lists["prefix_lens"], lists["extend_offsets"], lists["input_ids"])
        assert_same("out", out, want)
