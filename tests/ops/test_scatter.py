from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcanary.errors import InputError
from kvcanary.ops import scatter as scatter_mod
from kvcanary.ops._common import Backend
from kvcanary.ops.scatter import (
    ERR_OFFSETS,
    ERR_ROWS,
    SCATTER_VARIANTS,
    _scatter_grid,
    offsets_from_lengths,
    scatter_req_token_ids,
)

from . import reference as ref
from ._compare import assert_same
from ._helpers import INT32_MAX, INT32_MIN, SEEDS, WITH_NUMBA, WITH_NUMBA_IDS, device_for, run_op, token_ids

GUARD = 2
SENTINEL = -7


def make_inputs(gen: torch.Generator, bs: int, width: int, max_len: int, extra_rows: int = 2) -> dict:
    """Distinct rows per request (row 0 possibly once), some zero-length padding requests on row 0,
    lengths up to ``max_len`` (beyond ``width``: truncated), pool_out prefilled with random ids."""
    rows = bs + extra_rows + 1
    rpi = torch.randperm(rows, generator=gen)[:bs]
    lengths = torch.randint(0, max_len + 1, (bs,), generator=gen)
    pad = torch.rand(bs, generator=gen) < 0.2
    rpi[pad], lengths[pad] = 0, 0
    offsets = offsets_from_lengths(lengths)
    flat_in = token_ids(gen, int(offsets[-1]), INT32_MIN, INT32_MAX)
    pool_out = torch.randint(-1000, 1000, (rows, width), dtype=torch.int32, generator=gen)
    return dict(flat_in=flat_in, offsets=offsets, req_pool_indices=rpi, pool_out=pool_out)


def expected_pool(inputs: dict) -> list[list[int]]:
    return ref.scatter_req_token_ids(inputs["flat_in"].tolist(), inputs["offsets"].tolist(),
                                     inputs["req_pool_indices"].tolist(), inputs["pool_out"].tolist(),
                                     inputs["pool_out"].shape[1])


def check_all_backends(inputs: dict, backends=WITH_NUMBA) -> None:
    want = expected_pool(inputs)
    for backend in backends:
        args, flag = run_op(scatter_req_token_ids, backend, **inputs)
        assert_same(f"pool_out [{backend.value}]", args["pool_out"], want)
        assert flag.dtype == torch.int32 and flag.tolist() == [0], backend


@given(seed=SEEDS, bs=st.integers(0, 12), width=st.integers(1, 10))
def test_matches_reference(seed, bs, width):
    gen = torch.Generator().manual_seed(seed)
    check_all_backends(make_inputs(gen, bs, width, max_len=width + 3))


@given(seed=SEEDS, bs=st.integers(0, 12), width=st.integers(1, 10))
def test_lens_out_holds_each_segment_length_and_nothing_past_bs(seed, bs, width):
    gen = torch.Generator().manual_seed(seed)
    inputs = make_inputs(gen, bs, width, max_len=width + 3)
    off = inputs["offsets"].tolist()
    tail = torch.randint(-1000, 1000, (GUARD,), generator=gen)
    inputs["lens_out"] = torch.cat([torch.randint(-1000, 1000, (bs,), generator=gen), tail])
    want_pool = expected_pool(inputs)
    for backend in WITH_NUMBA:
        args, flag = run_op(scatter_req_token_ids, backend, **inputs)
        assert_same(f"pool_out [{backend.value}]", args["pool_out"], want_pool)
        assert_same(f"lens_out [{backend.value}]", args["lens_out"],
                    [off[r + 1] - off[r] for r in range(bs)] + tail.tolist())
        assert flag.tolist() == [0], backend


def test_lens_out_too_short_is_refused_before_any_write():
    inputs = valid_inputs()
    before = inputs["pool_out"].clone()
    with pytest.raises(InputError, match=r"lens_out length 1 < bs \(3\)"):
        scatter_req_token_ids(**inputs, lens_out=torch.zeros(1, dtype=torch.int64))
    assert torch.equal(inputs["pool_out"], before)


def test_empty_batch():
    pool = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    inputs = dict(flat_in=torch.zeros(0, dtype=torch.int64), offsets=torch.zeros(1, dtype=torch.int64),
                  req_pool_indices=torch.zeros(0, dtype=torch.int64), pool_out=pool)
    check_all_backends(inputs)


def test_truncates_at_width_and_keeps_the_rest_of_the_row():
    pool = torch.full((4, 5), -1, dtype=torch.int32)
    lengths = torch.tensor([5, 6, 4, 0])  # == width, width + 1, width - 1, empty
    inputs = dict(flat_in=torch.arange(1, 16), offsets=offsets_from_lengths(lengths),
                  req_pool_indices=torch.tensor([1, 3, 2, 0]), pool_out=pool)
    check_all_backends(inputs)
    args, _ = run_op(scatter_req_token_ids, Backend.TORCH, **inputs)
    assert args["pool_out"].tolist() == [[-1] * 5, [1, 2, 3, 4, 5], [12, 13, 14, 15, -1], [6, 7, 8, 9, 10]]


def test_int32_wraps_like_a_cast():
    inputs = dict(flat_in=torch.tensor([2**31, -(2**31) - 1, 2**32 + 5, -1]), offsets=torch.tensor([0, 4]),
                  req_pool_indices=torch.tensor([1]), pool_out=torch.zeros(2, 4, dtype=torch.int32))
    check_all_backends(inputs)


def test_one_long_request_spans_many_blocks():
    gen = torch.Generator().manual_seed(11)
    lengths = torch.tensor([3, 2500, 0, 1, 7])
    offsets = offsets_from_lengths(lengths)
    inputs = dict(flat_in=token_ids(gen, int(offsets[-1]), INT32_MIN, INT32_MAX), offsets=offsets,
                  req_pool_indices=torch.tensor([4, 2, 0, 1, 3]),
                  pool_out=torch.randint(0, 9, (6, 2600), dtype=torch.int32, generator=gen))
    check_all_backends(inputs)


def test_more_than_4096_requests():
    gen = torch.Generator().manual_seed(12)
    check_all_backends(make_inputs(gen, bs=5000, width=6, max_len=8))


@pytest.mark.parametrize("backend", WITH_NUMBA, ids=WITH_NUMBA_IDS)
def test_pool_out_may_be_a_column_slice(backend):
    gen = torch.Generator().manual_seed(13)
    inputs = make_inputs(gen, bs=6, width=5, max_len=7)
    big = torch.randint(0, 9, (inputs["pool_out"].shape[0], 9), dtype=torch.int32, generator=gen)
    big[:, 2:7] = inputs["pool_out"]
    dev = device_for(backend)
    out = big.to(dev, copy=True)
    scatter_req_token_ids(**{k: v.to(dev) for k, v in inputs.items() if k != "pool_out"}, pool_out=out[:, 2:7],
                          backend=backend)
    assert_same("pool_out slice", out[:, 2:7], expected_pool(inputs))
    assert_same("columns outside the slice", torch.cat([out[:, :2], out[:, 7:]], 1),
                torch.cat([big[:, :2], big[:, 7:]], 1))


def with_starts(gen: torch.Generator, inputs: dict) -> dict:
    """``inputs`` as appends: each request's segment starts at a random column, some past the
    width (nothing written), some at 0."""
    width, bs = inputs["pool_out"].shape[1], inputs["req_pool_indices"].shape[0]
    starts = torch.randint(0, width + 3, (bs,), generator=gen)
    starts[torch.rand(bs, generator=gen) < 0.2] = 0
    return {**inputs, "starts": starts}


def expected_appends(inputs: dict) -> list[list[int]]:
    return ref.scatter_req_token_ids(inputs["flat_in"].tolist(), inputs["offsets"].tolist(),
                                     inputs["req_pool_indices"].tolist(), inputs["pool_out"].tolist(),
                                     inputs["pool_out"].shape[1], inputs["starts"].tolist())


@given(seed=SEEDS, bs=st.integers(0, 12), width=st.integers(1, 10))
def test_appends_match_reference_and_keep_the_columns_before_them(seed, bs, width):
    gen = torch.Generator().manual_seed(seed)
    inputs = with_starts(gen, make_inputs(gen, bs, width, max_len=width + 3))
    off, starts = inputs["offsets"].tolist(), inputs["starts"].tolist()
    tail = torch.randint(-1000, 1000, (GUARD,), generator=gen)
    inputs["lens_out"] = torch.cat([torch.randint(-1000, 1000, (bs,), generator=gen), tail])
    want = expected_appends(inputs)
    assert want != inputs["pool_out"].tolist() or all(off[r + 1] == off[r] or starts[r] >= width for r in range(bs))
    for backend in WITH_NUMBA:
        args, flag = run_op(scatter_req_token_ids, backend, **inputs)
        assert_same(f"pool_out [{backend.value}]", args["pool_out"], want)
        assert_same(f"lens_out [{backend.value}]", args["lens_out"],
                    [starts[r] + off[r + 1] - off[r] for r in range(bs)] + tail.tolist())
        assert flag.tolist() == [0], backend


def test_appends_of_one_token_extend_a_history_sent_once():
    """A row's history scattered once, then one token a step at its next column: the row ends as
    one scatter of the whole history would leave it."""
    gen = torch.Generator().manual_seed(21)
    history = token_ids(gen, 3 * 9, INT32_MIN, INT32_MAX).view(3, 9)
    rows = torch.tensor([2, 0, 1])
    for backend in WITH_NUMBA:
        dev = device_for(backend)
        pool = torch.randint(-50, 50, (3, 12), dtype=torch.int32, generator=gen).to(dev)
        once = pool.clone()
        scatter_req_token_ids(flat_in=history[:, :5].reshape(-1).to(dev), offsets=torch.arange(0, 16, 5).to(dev),
                              req_pool_indices=rows.to(dev), pool_out=pool, backend=backend)
        lens = torch.zeros(3, dtype=torch.int64, device=dev)
        for col in range(5, 9):
            scatter_req_token_ids(flat_in=history[:, col].contiguous().to(dev), offsets=torch.arange(4).to(dev),
                                  req_pool_indices=rows.to(dev), pool_out=pool, lens_out=lens,
                                  starts=torch.full((3,), col, dtype=torch.int64, device=dev), backend=backend)
        scatter_req_token_ids(flat_in=history.reshape(-1).to(dev), offsets=torch.arange(0, 28, 9).to(dev),
                              req_pool_indices=rows.to(dev), pool_out=once, backend=backend)
        assert_same(f"appended rows [{backend.value}]", pool, once)
        assert lens.tolist() == [9, 9, 9], backend


# --- validation ------------------------------------------------------------------------------

def valid_inputs() -> dict:
    return dict(flat_in=torch.arange(7), offsets=torch.tensor([0, 3, 3, 7]), req_pool_indices=torch.tensor([1, 0, 2]),
                pool_out=torch.zeros(4, 8, dtype=torch.int32))


@pytest.mark.parametrize("change, exc, fragment", [
    (dict(flat_in=torch.arange(7, dtype=torch.int32)), TypeError, "flat_in dtype int32 != int64"),
    (dict(offsets=torch.tensor([0, 3, 3, 7], dtype=torch.int32)), TypeError, "offsets dtype int32 != int64"),
    (dict(req_pool_indices=torch.tensor([1.0, 0.0, 2.0])), TypeError, "req_pool_indices dtype float32 != int64"),
    (dict(pool_out=torch.zeros(4, 8, dtype=torch.int64)), TypeError, "pool_out dtype int64 != int32"),
    (dict(flat_in=[0, 1, 2]), TypeError, "flat_in must be a torch.Tensor, got list"),
    (dict(flat_in=torch.arange(8).reshape(2, 4)), ValueError, "flat_in must be 1-D, got shape (2, 4)"),
    (dict(offsets=torch.tensor([[0, 3, 3, 7]])), ValueError, "offsets must be 1-D"),
    (dict(req_pool_indices=torch.tensor(1)), ValueError, "req_pool_indices must be 1-D, got shape ()"),
    (dict(pool_out=torch.zeros(32, dtype=torch.int32)), ValueError, "pool_out must be 2-D"),
    (dict(offsets=torch.tensor([0, 3, 3, 7, 7])), ValueError, "offsets length 5 != bs+1 (4)"),
    (dict(offsets=torch.tensor([0, 3, 7])), ValueError, "offsets length 3 != bs+1 (4)"),
    (dict(offsets=torch.tensor([1, 3, 3, 7])), ValueError, "offsets[0] 1 != 0"),
    (dict(offsets=torch.tensor([0, 3, 2, 7])), ValueError, "offsets decrease at index 2: 2 < 3"),
    (dict(offsets=torch.tensor([0, 3, 3, 6])), ValueError, "offsets[-1] 6 != len(flat_in) (7)"),
    (dict(req_pool_indices=torch.tensor([1, 4, 2])), ValueError, r"req_pool_indices[1] = 4 out of range [0, 4)"),
    (dict(req_pool_indices=torch.tensor([1, 0, -1])), ValueError, r"req_pool_indices[2] = -1 out of range [0, 4)"),
    (dict(error_flag=torch.zeros(1, dtype=torch.int64)), TypeError, "error_flag dtype int64 != int32"),
    (dict(error_flag=torch.zeros(1, 1, dtype=torch.int32)), ValueError, "error_flag must be 1-D"),
    (dict(flat_in=torch.arange(7, device="meta")), ValueError, "flat_in is on the meta device"),
    (dict(starts=torch.tensor([0, 1, 2], dtype=torch.int32)), TypeError, "starts dtype int32 != int64"),
    (dict(starts=torch.tensor([0, 1])), ValueError, "starts length 2 != bs (3)"),
    (dict(starts=torch.tensor([0, 4, -1])), ValueError, "starts[2] = -1 < 0"),
])
def test_validation_errors(change, exc, fragment):
    for backend in WITH_NUMBA:
        with pytest.raises(exc) as info:
            scatter_req_token_ids(**{**valid_inputs(), **change}, backend=backend)
        assert fragment in str(info.value)


def test_offsets_error_tells_how_to_build_offsets():
    with pytest.raises(ValueError, match=r"offsets length 5 != bs\+1 \(4\); build offsets with offsets_from_lengths"):
        scatter_req_token_ids(**{**valid_inputs(), "offsets": torch.tensor([0, 3, 3, 7, 7])})


def test_triton_layout_errors():
    with pytest.raises(ValueError, match="flat_in must be contiguous"):
        scatter_req_token_ids(**{**valid_inputs(), "flat_in": torch.arange(14)[::2]}, backend=Backend.TRITON)
    pool_t = torch.zeros(8, 4, dtype=torch.int32).t()
    with pytest.raises(ValueError,
                       match=r"pool_out must have unit column stride and non-overlapping rows, got strides \(1, 4\)"):
        scatter_req_token_ids(**{**valid_inputs(), "pool_out": pool_t}, backend=Backend.TRITON)


def test_triton_backend_without_triton(monkeypatch):
    from kvcanary.ops import _common

    monkeypatch.setattr(_common, "HAS_TRITON", False)
    with pytest.raises(InputError, match="the Triton backend was requested but triton is not installed"):
        scatter_req_token_ids(**valid_inputs(), backend=Backend.TRITON)
    scatter_req_token_ids(**valid_inputs())  # CPU tensors take the torch path anyway


def test_offsets_from_lengths():
    assert offsets_from_lengths(torch.tensor([3, 0, 4], dtype=torch.int32)).tolist() == [0, 3, 3, 7]
    assert offsets_from_lengths(torch.zeros(0, dtype=torch.int64)).tolist() == [0]
    with pytest.raises(ValueError, match="lengths must be a 1-D tensor"):
        offsets_from_lengths(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="lengths dtype torch.float32 is not an integer dtype"):
        offsets_from_lengths(torch.ones(3))
    with pytest.raises(ValueError, match="lengths must be >= 0, got min -2"):
        offsets_from_lengths(torch.tensor([1, -2]))


# --- device-side safety ------------------------------------------------------------------------

def guarded_pool(rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(buffer, pool_out view, guard mask): the view sits inside a sentinel-filled buffer with
    GUARD rows and columns on every side."""
    big = torch.full((rows + 2 * GUARD, width + 2 * GUARD), SENTINEL, dtype=torch.int32)
    inner = (slice(GUARD, GUARD + rows), slice(GUARD, GUARD + width))
    big[inner] = torch.arange(rows * width, dtype=torch.int32).reshape(rows, width) + 100
    guard = torch.ones_like(big, dtype=torch.bool)
    guard[inner] = False
    return big, big[inner], guard


BAD_VALUES = [  # (offsets, req_pool_indices, expected error bits); flat_in has 7 ids, pool has 4 rows
    ([0, 3, 3, 7], [1, 0, 2], 0),
    ([2, 3, 3, 7], [1, 0, 2], ERR_OFFSETS),
    ([0, 5, 3, 7], [1, 0, 2], ERR_OFFSETS),
    ([0, 3, 3, 9], [1, 0, 2], ERR_OFFSETS),
    ([0, 3, 3, 5], [1, 0, 2], ERR_OFFSETS),
    ([-4, 3, 3, 7], [1, 3, 2], ERR_OFFSETS),
    ([0, -2**40, 3, 7], [1, 3, 2], ERR_OFFSETS),
    ([0, 3, 3, 7], [1, 4, 2], ERR_ROWS),
    ([0, 3, 3, 7], [-1, 0, 2**40], ERR_ROWS),
    ([0, 9, 2, 7], [3, -5, 2], ERR_OFFSETS | ERR_ROWS),
]


@pytest.mark.parametrize("backend", WITH_NUMBA, ids=WITH_NUMBA_IDS)
@pytest.mark.parametrize("offsets, rows, bits", BAD_VALUES)
def test_device_values_are_masked_and_flagged(monkeypatch, backend, offsets, rows, bits):
    """Device tensors skip the value checks: bad offsets and rows only raise flag bits, and
    nothing outside the valid addressed rows changes."""
    monkeypatch.setattr(scatter_mod, "is_host", lambda t: False)  # validate as for device tensors
    big, _, guard = guarded_pool(4, 3)
    before = big.clone()
    big = big.to(device_for(backend))
    flag = torch.tensor([64], dtype=torch.int32, device=big.device)  # bits already set stay set
    flat_in = torch.arange(1, 8)
    scatter_req_token_ids(flat_in=flat_in.to(big.device), offsets=torch.tensor(offsets, device=big.device),
                          req_pool_indices=torch.tensor(rows, device=big.device),
                          pool_out=big[GUARD:GUARD + 4, GUARD:GUARD + 3], error_flag=flag, backend=backend)
    big = big.cpu()
    assert flag.tolist() == [64 | bits]
    assert_same("guards", big[guard], before[guard])
    addressed = {r for r in rows if 0 <= r < 4}
    for r in set(range(4)) - addressed:
        assert_same(f"row {r} (not addressed)", big[GUARD + r], before[GUARD + r])
    if bits in (0, ERR_ROWS):  # good offsets: valid rows are written as usual, bad ones skipped
        scratch = 4  # the reference writes skipped requests into an extra row, dropped after
        pool = before[GUARD:GUARD + 4, GUARD:GUARD + 3].tolist() + [[0] * 3]
        mapped = [r if r in addressed else scratch for r in rows]
        want = ref.scatter_req_token_ids(flat_in.tolist(), offsets, mapped, pool, 3)[:4]
        assert_same("pool_out", big[GUARD:GUARD + 4, GUARD:GUARD + 3], want)


@pytest.mark.parametrize("backend", WITH_NUMBA, ids=WITH_NUMBA_IDS)
def test_device_negative_starts_are_masked_and_flagged(monkeypatch, backend):
    """A negative start on device tensors writes nothing for its request and raises ERR_OFFSETS;
    the other requests append as usual, and nothing outside the pool changes."""
    monkeypatch.setattr(scatter_mod, "is_host", lambda t: False)
    big, _, guard = guarded_pool(4, 3)
    before = big.clone()
    dev = device_for(backend)
    big = big.to(dev)
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    lens = torch.zeros(3, dtype=torch.int64, device=dev)
    scatter_req_token_ids(flat_in=torch.arange(1, 8, device=dev), offsets=torch.tensor([0, 3, 5, 7], device=dev),
                          req_pool_indices=torch.tensor([1, 3, 2], device=dev),
                          pool_out=big[GUARD:GUARD + 4, GUARD:GUARD + 3], error_flag=flag, lens_out=lens,
                          starts=torch.tensor([-2**40, 1, 2], device=dev), backend=backend)
    big = big.cpu()
    assert flag.tolist() == [ERR_OFFSETS]
    assert_same("guards", big[guard], before[guard])
    pool = before[GUARD:GUARD + 4, GUARD:GUARD + 3].tolist()
    want = ref.scatter_req_token_ids(list(range(1, 8)), [0, 3, 5, 7], [0, 3, 2], pool, 3, [3, 1, 2])
    assert_same("pool_out", big[GUARD:GUARD + 4, GUARD:GUARD + 3], want)  # row 1 untouched
    assert lens[1:].tolist() == [3, 4]


@pytest.mark.parametrize("backend", WITH_NUMBA, ids=WITH_NUMBA_IDS)
def test_device_bad_rows_with_many_requests(monkeypatch, backend):
    """The flag scan covers every request, not only the first block."""
    monkeypatch.setattr(scatter_mod, "is_host", lambda t: False)
    bs = 3000
    rpi = torch.arange(1, bs + 1)
    rpi[2500] = bs + 7
    good = dict(flat_in=torch.arange(bs), offsets=torch.arange(bs + 1), req_pool_indices=torch.arange(1, bs + 1),
                pool_out=torch.zeros(bs + 1, 2, dtype=torch.int32))
    _, flag = run_op(scatter_req_token_ids, backend, **{**good, "req_pool_indices": rpi})
    assert flag.tolist() == [ERR_ROWS]
    offsets = torch.arange(bs + 1)
    offsets[2900] = 2950
    _, flag = run_op(scatter_req_token_ids, backend, **{**good, "offsets": offsets})
    assert flag.tolist() == [ERR_OFFSETS]


def test_every_launch_shape_is_one_a_warm_up_compiles():
    """``_scatter_grid`` picks only (BLOCK, warps) pairs of ``SCATTER_VARIANTS`` (the warm-up compiles
    each), covers a mean segment in one pass of its programs, and gives every pair for some size."""
    seen = set()
    for bs in (1, 2, 7, 64, 255, 256, 511, 1024, 4096):
        for mean in (1, 100, 128, 129, 200, 256, 257, 300, 512, 513, 600, 2048, 8192, 70000):
            programs, split, block, warps = _scatter_grid(bs * mean, bs)
            assert (block, warps) in SCATTER_VARIANTS and programs == bs + 1 and 1 <= split <= 64
            assert split * block >= min(mean, 64 * block), (bs, mean, split, block)
            seen.add((block, warps))
    assert seen == set(SCATTER_VARIANTS)


def test_the_compiled_scatter_reads_nothing_past_arrays_of_the_wrong_length():
    """Called directly with offsets, starts or lengths shorter than the batch (the op checks them
    first), the compiled scatter writes nothing; short offsets or starts are flagged as bad
    offsets."""
    import numpy as np

    from kvcanary.ops import _cpu
    from kvcanary.ops.backend import cpu_kernels_usable

    if not cpu_kernels_usable():
        pytest.skip("numba does not serve here")
    k = _cpu.kernel("scatter")
    i64 = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731
    for offsets, starts, lens, flagged in ((i64(0, 2), i64(0, 1), i64(0, 0), True),
                                           (i64(0, 2, 4), i64(1), i64(0, 0), True),
                                           (i64(0, 2, 4), i64(0, 1), i64(0), False)):
        out, err = np.full((4, 6), -7, dtype=np.int32), np.zeros(1, dtype=np.int32)
        assert k(i64(5, 6, 7, 8), offsets, i64(1, 2), out, err, lens, True, False, starts, True) == 0
        assert bool(err[0] & 1) is flagged and (out == -7).all()
    out, err = np.full((4, 6), -7, dtype=np.int32), np.zeros(1, dtype=np.int32)  # the right lengths: written
    assert k(i64(5, 6, 7, 8), i64(0, 2, 4), i64(1, 2), out, err, i64(0, 0), True, False, i64(0, 1), True) == 0
    assert err[0] == 0 and out[1, :2].tolist() == [5, 6] and out[2, 1:3].tolist() == [7, 8]
