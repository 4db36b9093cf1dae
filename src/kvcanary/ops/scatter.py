"""scatter_req_token_ids: scatter per-request token ids into a page-table-shaped table.

Contract (the op users know from sglang, keyword for keyword):

| argument          | dtype / shape        | meaning                                          |
|-------------------|----------------------|--------------------------------------------------|
| flat_in           | int64[N]             | every request's ids, request after request       |
| offsets           | int64[bs+1]          | request r owns flat_in[offsets[r]:offsets[r+1]]  |
| req_pool_indices  | int64[bs]            | destination row of request r                     |
| pool_out          | int32[rows, width]   | written in place                                 |
| starts            | int64[bs] or None    | column request r's segment starts at (default 0) |

For each request r: ``pool_out[req_pool_indices[r], :n] = int32(flat_in[offsets[r]:offsets[r]+n])``
with ``n = min(offsets[r+1] - offsets[r], width)``; rows not addressed stay untouched; with
``lens_out`` (int64[>= bs]), also ``lens_out[r] = offsets[r+1] - offsets[r]`` in the same launch. No batch
cap. With ``starts`` a segment is an append: ``pool_out[row_r, s : s + n] = ...`` with ``s =
starts[r]`` and ``n = min(len_r, width - s)`` (nothing past ``width``), the columns before ``s``
kept, and ``lens_out[r] = s + len_r``: a row's history sent once and then only what each step
adds (fixed sizes at a fixed batch size, so a CUDA graph can capture it). Host tensors get value
checks (offsets start at 0, never decrease, end at N; rows in range; starts >= 0) with a
ValueError. Device tensors are never synced: a request whose segment is not inside [0, N] (or
runs backwards), whose start is negative or whose row is out of range writes nothing, so
nothing is read or written out of bounds, and ``error_flag`` (int32[1]) gets ``ERR_OFFSETS``
and/or ``ERR_ROWS`` OR-ed in for the caller to check.
"""

from __future__ import annotations

import torch

from kvcanary.errors import InputError, InputTypeError
from kvcanary.ops import _cpu
from kvcanary.ops._common import (
    Backend,
    check_contiguous,
    check_same_device,
    check_table,
    check_tensor,
    is_host,
    tl,
    triton,
    use_triton,
)
from kvcanary.ops._cpu import use_numba
from kvcanary.ops.launcher import launch_typed

ERR_OFFSETS = 1
ERR_ROWS = 2


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """``int64[bs+1]`` offsets (0, l0, l0+l1, ...) from ``lengths[bs]`` (any integer dtype)."""
    if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1:
        raise InputError(f"lengths must be a 1-D tensor, got {getattr(lengths, 'shape', type(lengths).__name__)}")
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise InputTypeError(f"lengths dtype {lengths.dtype} is not an integer dtype")
    if is_host(lengths) and lengths.numel() and int(lengths.min()) < 0:
        raise InputError(f"lengths must be >= 0, got min {int(lengths.min())}")
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.to(torch.int64), 0, out=out[1:])
    return out


def validate_scatter(flat_in, offsets, req_pool_indices, pool_out, starts=None) -> torch.device:
    check_tensor("flat_in", flat_in, torch.int64, 1)
    check_tensor("offsets", offsets, torch.int64, 1)
    check_tensor("req_pool_indices", req_pool_indices, torch.int64, 1)
    check_tensor("pool_out", pool_out, torch.int32, 2)
    device = check_same_device(flat_in=flat_in, offsets=offsets, req_pool_indices=req_pool_indices,
                               pool_out=pool_out)
    for name, t in (("flat_in", flat_in), ("offsets", offsets), ("req_pool_indices", req_pool_indices)):
        check_contiguous(name, t)
    check_table("pool_out", pool_out)
    bs = req_pool_indices.shape[0]
    if offsets.shape[0] != bs + 1:
        raise InputError(f"offsets length {offsets.shape[0]} != bs+1 ({bs + 1}); "
                         "build offsets with offsets_from_lengths(lengths)")
    if starts is not None:
        check_tensor("starts", starts, torch.int64, 1)
        check_same_device(pool_out=pool_out, starts=starts)
        check_contiguous("starts", starts)
        if starts.shape[0] != bs:
            raise InputError(f"starts length {starts.shape[0]} != bs ({bs}); pass one start column per request")
        if is_host(starts) and bs and int(starts.min()) < 0:
            i = int(torch.nonzero(starts < 0)[0])
            raise InputError(f"starts[{i}] = {int(starts[i])} < 0; a segment starts at a column >= 0")
    if is_host(offsets) and not _host_values_ok(flat_in, offsets, req_pool_indices, pool_out):
        n = flat_in.shape[0]
        if int(offsets[0]) != 0:
            raise InputError(f"offsets[0] {int(offsets[0])} != 0; offsets must start at 0")
        if bs and bool((offsets[1:] < offsets[:-1]).any()):
            i = int(torch.nonzero(offsets[1:] < offsets[:-1])[0])
            raise InputError(f"offsets decrease at index {i + 1}: {int(offsets[i + 1])} < {int(offsets[i])}; "
                             "offsets must be non-decreasing")
        if int(offsets[-1]) != n:
            raise InputError(f"offsets[-1] {int(offsets[-1])} != len(flat_in) ({n})")
        rows = pool_out.shape[0]
        bad = (req_pool_indices < 0) | (req_pool_indices >= rows)
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise InputError(f"req_pool_indices[{i}] = {int(req_pool_indices[i])} out of range [0, {rows})")
    return device


def _host_values_ok(flat_in, offsets, req_pool_indices, pool_out) -> bool:
    """All of ``validate_scatter``'s host value checks at once, in numpy (a few microseconds; the
    torch calls cost ~20 us a call): the detailed checks run only when one fails."""
    off, rpi = offsets.numpy(), req_pool_indices.numpy()
    return bool(off[0] == 0 and off[-1] == flat_in.shape[0] and (off[1:] >= off[:-1]).all()
                and ((rpi >= 0) & (rpi < pool_out.shape[0])).all())


def _segment_ok(offsets, req_pool_indices, n: int, rows: int) -> torch.Tensor:
    """Per request: its segment lies inside flat_in and its row inside pool_out."""
    start, end = offsets[:-1], offsets[1:]
    return (start >= 0) & (start <= end) & (end <= n) & (req_pool_indices >= 0) & (req_pool_indices < rows)


def _scatter_torch(flat_in, offsets, req_pool_indices, pool_out, error_flag, lens_out=None, starts=None) -> None:
    n, bs = flat_in.shape[0], req_pool_indices.shape[0]
    if lens_out is not None:
        torch.sub(offsets[1:], offsets[:-1], out=lens_out[:bs])
        if starts is not None:
            lens_out[:bs] += starts
    rows, width = pool_out.shape
    bad_offsets = (offsets[0] != 0) | (offsets[-1] != n) | (offsets[1:] < offsets[:-1]).any()
    if starts is not None:
        bad_offsets |= (starts < 0).any()
    bad_rows = ((req_pool_indices < 0) | (req_pool_indices >= rows)).any()
    error_flag |= bad_offsets.to(torch.int32) * ERR_OFFSETS | bad_rows.to(torch.int32) * ERR_ROWS
    if bs == 0:
        return
    ok = _segment_ok(offsets, req_pool_indices, n, rows)
    first = torch.zeros_like(offsets[1:]) if starts is None else starts
    if starts is not None:
        ok &= starts >= 0
    room = (width - first).clamp(min=0)
    count = torch.where(ok, torch.minimum((offsets[1:] - offsets[:-1]).clamp(min=0), room), torch.zeros_like(room))
    r = torch.repeat_interleave(torch.arange(bs, device=flat_in.device), count)
    col = torch.arange(r.numel(), device=flat_in.device) - (torch.cumsum(count, 0) - count)[r]
    pool_out[req_pool_indices[r], first[r] + col] = flat_in[offsets[r] + col].to(torch.int32)


# the sizes vary with every batch: specialising on them would compile a variant per shape
@triton.jit(do_not_specialize=["n", "bs", "rows", "width", "out_stride"])
def _scatter_kernel(flat_ptr, off_ptr, rpi_ptr, out_ptr, err_ptr, lens_ptr, starts_ptr, n, bs, rows, width,
                    out_stride, BLOCK: tl.constexpr, HAS_LENS: tl.constexpr, HAS_STARTS: tl.constexpr):
    """Program (r + 1, k) copies chunks k, k + SPLIT, ... (BLOCK tokens each) of request r:
    pool_out[rpi[r], s : s + cnt] = flat_in[start : start + cnt], s = starts[r] (HAS_STARTS; else
    0), cnt = min(end - start, width - s), when 0 <= start <= end <= n, s >= 0 and the row is in
    range (else nothing). No search: each program reads its own offsets. Program (r + 1, 0) writes
    lens[r] = s + end - start (HAS_LENS) and raises the error flag for its own request (end <
    start or s < 0: ERR_OFFSETS; the row out of range: ERR_ROWS); program (0, 0) for the first
    and last offsets (not 0 and n). Together they flag what a scan of every offset, start and
    row would, with no program walking the requests (one did; H200: 16384 x 64 56.8 -> 14.4 µs,
    decode appends of 256 x 1 2.75 -> 1.60). Each token is read and written once: its loads are
    evicted first and its stores streamed (256 x 8192 8.83 -> 8.46 µs; BENCHMARKS.md)."""
    r = tl.program_id(0).to(tl.int64) - 1
    k = tl.program_id(1).to(tl.int64)
    split = tl.num_programs(1).to(tl.int64)
    has = r >= 0
    r = tl.maximum(r, 0)  # the check's program reads no request
    has = has & (r < bs)
    start = tl.load(off_ptr + r, mask=has, other=0)
    end = tl.load(off_ptr + r + 1, mask=has, other=0)
    row = tl.load(rpi_ptr + r, mask=has, other=-1)
    first = tl.zeros((), dtype=tl.int64)
    if HAS_STARTS:
        first = tl.load(starts_ptr + r, mask=has, other=0)
    ok = has & (start >= 0) & (start <= end) & (end <= n) & (row >= 0) & (row < rows) & (first >= 0)
    cnt = tl.where(ok, tl.maximum(tl.minimum(end - start, width - first), 0), 0)
    if HAS_LENS:
        tl.store(lens_ptr + r, first + end - start, mask=has & (k == 0))
    dst = out_ptr + row * out_stride + first
    for c in range(k * BLOCK, cnt, split * BLOCK):
        j = c + tl.arange(0, BLOCK).to(tl.int64)
        m = j < cnt
        v = tl.load(flat_ptr + start + j, mask=m, other=0, eviction_policy="evict_first")
        tl.store(dst + j, v.to(tl.int32), mask=m, cache_modifier=".cs")
    code = tl.where(has, ((end < start) | (first < 0)).to(tl.int32) + ((row < 0) | (row >= rows)).to(tl.int32) * 2, 0)
    if tl.program_id(0) == 0:  # the ends of the offsets
        code = ((tl.load(off_ptr) != 0) | (tl.load(off_ptr + bs) != n)).to(tl.int32)
    if (code != 0) & (k == 0):  # relaxed: no fence in every program for a flag read after the launch
        tl.atomic_or(err_ptr, code, sem="relaxed")


MIN_PROGRAMS = 512  # fewer requests than this spread each one over more, shorter programs
# every (BLOCK, warps) ``_scatter_grid`` picks: the kernel variants a warm-up compiles
SCATTER_VARIANTS = ((128, 4), (256, 4), (512, 4), (512, 8))


def _scatter_grid(n: int, bs: int) -> tuple[int, int, int, int]:
    """(programs along the requests: bs + 1, the first checking the offsets' ends; programs per
    request, BLOCK, warps) from shapes alone: BLOCK ~ the mean segment (128..512), enough programs
    per request to cover a mean segment in one pass (at most 64). A mean of 129..256 tokens takes
    BLOCK 512 with 8 warps (two 8-byte loads a thread; H200, 4096 x 256: 11.3 -> 8.6 µs); longer
    segments take more programs of 512, not larger blocks; while the launch has fewer than
    ``MIN_PROGRAMS`` programs BLOCK halves (to 256) and the programs per request double (64 x
    2048: 3.5 -> 2.8 µs; BENCHMARKS.md)."""
    mean = -(-n // bs) if bs > 1 else n  # plain int arithmetic: this runs on every step's host path
    block = 128 if mean <= 128 else 512 if mean > 256 else 256
    split = min(max(-(-mean // block), 1), 64)
    if block == 256:
        return bs + 1, split, 512, 8
    while bs * split < MIN_PROGRAMS and block > 256 and split < 64:
        block, split = block // 2, split * 2
    return bs + 1, split, block, 4


_SCATTER_CONSTEXPRS: dict[tuple, dict] = {}  # (BLOCK, HAS_LENS, HAS_STARTS) -> the launch's constexprs


def scatter_req_token_ids(*, flat_in: torch.Tensor, offsets: torch.Tensor, req_pool_indices: torch.Tensor,
                          pool_out: torch.Tensor, error_flag: torch.Tensor | None = None,
                          lens_out: torch.Tensor | None = None, starts: torch.Tensor | None = None,
                          backend: Backend = Backend.AUTO) -> torch.Tensor:
    """Scatter ``flat_in`` segments into rows of ``pool_out`` (see module doc); returns ``error_flag``.

    Raises TypeError for wrong dtypes and ValueError for wrong ranks, a wrong offsets or starts
    length, and (host tensors only) bad offsets, starts or rows. ``error_flag`` is int32[1],
    allocated when not given; pass a preallocated one inside CUDA-graph capture. ``lens_out``
    (int64[>= bs], optional) receives each request's length (its start plus its segment).
    ``starts`` (int64[bs], optional): the column each segment starts at (an append).
    """
    device = validate_scatter(flat_in, offsets, req_pool_indices, pool_out, starts)
    if error_flag is None:
        error_flag = torch.zeros(1, dtype=torch.int32, device=device)
    check_tensor("error_flag", error_flag, torch.int32, 1)
    if error_flag.shape[0] != 1:
        raise InputError(f"error_flag must be int32[1], got shape {tuple(error_flag.shape)}")
    check_same_device(pool_out=pool_out, error_flag=error_flag)
    if lens_out is not None:
        check_tensor("lens_out", lens_out, torch.int64, 1)
        check_contiguous("lens_out", lens_out)
        check_same_device(pool_out=pool_out, lens_out=lens_out)
        if lens_out.shape[0] < req_pool_indices.shape[0]:
            raise InputError(f"lens_out length {lens_out.shape[0]} < bs ({req_pool_indices.shape[0]}); "
                             "pass one int64 per request")
    if use_numba(backend, device):
        _cpu.scatter(flat_in, offsets, req_pool_indices, pool_out, error_flag, lens_out, starts)
        return error_flag
    scatter_validated(flat_in, offsets, req_pool_indices, pool_out, error_flag, lens_out,
                      use_triton(backend, device), starts)
    return error_flag


def scatter_validated(flat_in, offsets, req_pool_indices, pool_out, error_flag, lens_out, triton_path: bool,
                      starts=None, variant: tuple[int, int] | None = None) -> None:
    """The launch of ``scatter_req_token_ids`` for arguments already checked (dtypes, ranks, one
    device, contiguity, ``offsets`` length bs+1, ``error_flag`` int32[1], ``lens_out`` int64[>= bs]
    or None, ``starts`` int64[bs] or None): the runtime's per-step path, whose tensors were checked
    when their batch was built. ``variant``: launch with this (BLOCK, warps) of
    ``SCATTER_VARIANTS`` instead of the one the sizes pick (a warm-up compiling each)."""
    if triton_path:
        n, bs = flat_in.shape[0], req_pool_indices.shape[0]
        programs, split, block, warps = _scatter_grid(n, bs)
        if variant is not None:
            block, warps = variant
        has_lens, has_starts = lens_out is not None, starts is not None
        constexprs = _SCATTER_CONSTEXPRS.get((block, has_lens, has_starts))
        if constexprs is None:
            constexprs = _SCATTER_CONSTEXPRS[block, has_lens, has_starts] = dict(BLOCK=block, HAS_LENS=has_lens,
                                                                                 HAS_STARTS=has_starts)
        rows, width = pool_out.shape
        # checked dtypes: the variant (BLOCK, HAS_LENS, HAS_STARTS) fixes them and the constexprs
        launch_typed(_scatter_kernel, (programs, split), (
            flat_in, offsets, req_pool_indices, pool_out, error_flag, lens_out if has_lens else error_flag,
            starts if has_starts else offsets), (n, bs, rows, width, pool_out.stride(0)),
            (block, has_lens, has_starts), constexprs, num_warps=warps)
    else:
        _scatter_torch(flat_in, offsets, req_pool_indices, pool_out, error_flag, lens_out, starts)
