"""scatter_req_token_ids: scatter per-request token ids into a page-table-shaped table.

Contract (the op users know from sglang, keyword for keyword):

| argument          | dtype / shape        | meaning                                          |
|-------------------|----------------------|--------------------------------------------------|
| flat_in           | int64[N]             | every request's ids, request after request       |
| offsets           | int64[bs+1]          | request r owns flat_in[offsets[r]:offsets[r+1]]  |
| req_pool_indices  | int64[bs]            | destination row of request r                     |
| pool_out          | int32[rows, width]   | written in place                                 |

For each request r: ``pool_out[req_pool_indices[r], :n] = int32(flat_in[offsets[r]:offsets[r]+n])``
with ``n = min(offsets[r+1] - offsets[r], width)``; rows not addressed stay untouched. No batch
cap. Host tensors get value checks (offsets start at 0, never decrease, end at N; rows in
range) with a ValueError. Device tensors are never synced: bad values are masked so nothing is
read or written out of bounds, and ``error_flag`` (int32[1]) gets ``ERR_OFFSETS`` and/or
``ERR_ROWS`` OR-ed in for the caller to check.
"""

from __future__ import annotations

import torch

from kvcanary.ops._common import (
    Backend,
    cdiv,
    check_contiguous,
    check_same_device,
    check_tensor,
    is_host,
    num_bits,
    searchsorted_right,
    tl,
    triton,
    use_triton,
)
from kvcanary.ops._jit import find_segment

ERR_OFFSETS = 1
ERR_ROWS = 2


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """``int64[bs+1]`` offsets (0, l0, l0+l1, ...) from ``lengths[bs]`` (any integer dtype)."""
    if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1:
        raise ValueError(f"lengths must be a 1-D tensor, got {getattr(lengths, 'shape', type(lengths).__name__)}")
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise TypeError(f"lengths dtype {lengths.dtype} is not an integer dtype")
    if is_host(lengths) and lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"lengths must be >= 0, got min {int(lengths.min())}")
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.to(torch.int64), 0, out=out[1:])
    return out


def validate_scatter(flat_in, offsets, req_pool_indices, pool_out) -> torch.device:
    check_tensor("flat_in", flat_in, torch.int64, 1)
    check_tensor("offsets", offsets, torch.int64, 1)
    check_tensor("req_pool_indices", req_pool_indices, torch.int64, 1)
    check_tensor("pool_out", pool_out, torch.int32, 2)
    device = check_same_device(flat_in=flat_in, offsets=offsets, req_pool_indices=req_pool_indices,
                               pool_out=pool_out)
    bs = req_pool_indices.shape[0]
    if offsets.shape[0] != bs + 1:
        raise ValueError(f"offsets length {offsets.shape[0]} != bs+1 ({bs + 1}); "
                         "build offsets with offsets_from_lengths(lengths)")
    if is_host(offsets):
        n = flat_in.shape[0]
        if int(offsets[0]) != 0:
            raise ValueError(f"offsets[0] {int(offsets[0])} != 0; offsets must start at 0")
        if bs and bool((offsets[1:] < offsets[:-1]).any()):
            i = int(torch.nonzero(offsets[1:] < offsets[:-1])[0])
            raise ValueError(f"offsets decrease at index {i + 1}: {int(offsets[i + 1])} < {int(offsets[i])}; "
                             "offsets must be non-decreasing")
        if int(offsets[-1]) != n:
            raise ValueError(f"offsets[-1] {int(offsets[-1])} != len(flat_in) ({n})")
        rows = pool_out.shape[0]
        bad = (req_pool_indices < 0) | (req_pool_indices >= rows)
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise ValueError(f"req_pool_indices[{i}] = {int(req_pool_indices[i])} out of range [0, {rows})")
    return device


def _scatter_torch(flat_in, offsets, req_pool_indices, pool_out, error_flag) -> None:
    n, bs = flat_in.shape[0], req_pool_indices.shape[0]
    rows, width = pool_out.shape
    bad_offsets = (offsets[0] != 0) | (offsets[-1] != n) | (offsets[1:] < offsets[:-1]).any()
    bad_rows = ((req_pool_indices < 0) | (req_pool_indices >= rows)).any()
    error_flag |= bad_offsets.to(torch.int32) * ERR_OFFSETS | bad_rows.to(torch.int32) * ERR_ROWS
    if n == 0 or bs == 0:
        return
    i = torch.arange(n, device=flat_in.device)
    r = searchsorted_right(offsets[1:], i)
    rc = r.clamp(max=bs - 1)
    start = offsets[rc]
    col = i - start
    row = req_pool_indices[rc]
    ok = (r < bs) & (start <= i) & (i < offsets[rc + 1]) & (col < width) & (row >= 0) & (row < rows)
    pool_out[row[ok], col[ok]] = flat_in[ok].to(torch.int32)


@triton.jit
def _scatter_kernel(flat_ptr, off_ptr, rpi_ptr, out_ptr, err_ptr, n, bs, rows, width,
                    out_stride, NBITS: tl.constexpr, BLOCK: tl.constexpr):
    """Lane i of program p handles flat_in[p*BLOCK + i]: binary-search its request r in the
    offsets, then write pool_out[rpi[r], i - offsets[r]] if that is inside the segment, the row
    range and the width. Program 0 also checks offsets and rows and raises the error flag."""
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    live = i < n
    r = find_segment(off_ptr + 1, i, bs, NBITS)
    has_r = live & (r < bs)
    start = tl.load(off_ptr + r, mask=has_r, other=0)
    end = tl.load(off_ptr + r + 1, mask=has_r, other=0)
    row = tl.load(rpi_ptr + r, mask=has_r, other=-1)
    col = i - start
    ok = has_r & (start <= i) & (i < end) & (col < width) & (row >= 0) & (row < rows)
    val = tl.load(flat_ptr + i, mask=ok, other=0)
    tl.store(out_ptr + row * out_stride + col, val.to(tl.int32), mask=ok)
    if pid == 0:
        bad = (tl.load(off_ptr) != 0) | (tl.load(off_ptr + bs) != n)
        bad_off = bad.to(tl.int32)
        bad_row = tl.zeros((), dtype=tl.int32)
        for s in range(0, bs, BLOCK):
            j = s + tl.arange(0, BLOCK).to(tl.int64)
            m = j < bs
            a = tl.load(off_ptr + j, mask=m, other=0)
            b = tl.load(off_ptr + j + 1, mask=m, other=0)
            rr = tl.load(rpi_ptr + j, mask=m, other=0)
            bad_off = tl.maximum(bad_off, tl.max((m & (b < a)).to(tl.int32), 0))
            bad_row = tl.maximum(bad_row, tl.max((m & ((rr < 0) | (rr >= rows))).to(tl.int32), 0))
        code = bad_off * 1 + bad_row * 2
        tl.atomic_or(err_ptr, code, mask=code != 0)


def scatter_req_token_ids(*, flat_in: torch.Tensor, offsets: torch.Tensor, req_pool_indices: torch.Tensor,
                          pool_out: torch.Tensor, error_flag: torch.Tensor | None = None,
                          backend: Backend = Backend.AUTO) -> torch.Tensor:
    """Scatter ``flat_in`` segments into rows of ``pool_out`` (see module doc); returns ``error_flag``.

    Raises TypeError for wrong dtypes and ValueError for wrong ranks, a wrong offsets length,
    and (host tensors only) bad offsets or rows. ``error_flag`` is int32[1], allocated when not
    given; pass a preallocated one inside CUDA-graph capture.
    """
    device = validate_scatter(flat_in, offsets, req_pool_indices, pool_out)
    if error_flag is None:
        error_flag = torch.zeros(1, dtype=torch.int32, device=device)
    check_tensor("error_flag", error_flag, torch.int32, 1)
    if use_triton(backend, device):
        check_contiguous("flat_in", flat_in)
        check_contiguous("offsets", offsets)
        check_contiguous("req_pool_indices", req_pool_indices)
        if pool_out.stride(1) != 1:
            raise ValueError(f"pool_out must have unit column stride, got strides {pool_out.stride()}")
        n, bs = flat_in.shape[0], req_pool_indices.shape[0]
        block = 1024
        _scatter_kernel[(max(cdiv(n, block), 1),)](
            flat_in, offsets, req_pool_indices, pool_out, error_flag, n, bs,
            pool_out.shape[0], pool_out.shape[1], pool_out.stride(0), NBITS=num_bits(bs), BLOCK=block,
            num_warps=4)
    else:
        _scatter_torch(flat_in, offsets, req_pool_indices, pool_out, error_flag)
    return error_flag
