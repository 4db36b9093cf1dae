"""gather_expected_tokens: the truth token for every token a forward writes.

| argument          | dtype / shape        | meaning                                            |
|-------------------|----------------------|----------------------------------------------------|
| truth             | int32[rows, width]   | per page-table row: origin + output ids            |
| truth_lens        | int64[bs]            | valid truth ids of request r                       |
| req_pool_indices  | int64[bs]            | row of request r (0 = padding: no truth)           |
| prefix_lens       | int64[bs]            | position of request r's first written token        |
| extend_offsets    | int64[bs+1]          | request r writes tokens [off[r], off[r+1])         |
| input_ids         | int64[T]             | the ids the forward writes                         |
| out               | int64[T]             | expected token per written token                   |

Token t of request r sits at ``p = prefix_lens[r] + (t - off[r]) + shift``; ``shift = 1`` is the
speculative-draft mode where draft t predicts the token after its input. The expected token is
``truth[row, p]`` when ``row >= 1`` and ``0 <= p < min(truth_lens[r], width)``, else ``input_ids[t]``
(no truth known: the write check passes). No batch cap: requests are found by binary search.
"""

from __future__ import annotations

import torch

from kvcanary.errors import InputError, InputTypeError
from kvcanary.ops._common import (
    Backend,
    cdiv,
    check_contiguous,
    check_len,
    check_no_alias,
    check_same_device,
    check_table,
    check_tensor,
    is_host,
    num_bits,
    searchsorted_right,
    tl,
    triton,
    use_triton,
)
from kvcanary.ops._jit import find_segment


def validate_offsets(name: str, offsets: torch.Tensor, bs: int, total: int) -> None:
    """Length always; start/monotonic/end only for host tensors."""
    if offsets.shape[0] != bs + 1:
        raise InputError(f"{name} length {offsets.shape[0]} != bs+1 ({bs + 1}); "
                         "build it with offsets_from_lengths(lengths)")
    if is_host(offsets):
        if int(offsets[0]) != 0:
            raise InputError(f"{name}[0] {int(offsets[0])} != 0")
        if bs and bool((offsets[1:] < offsets[:-1]).any()):
            i = int(torch.nonzero(offsets[1:] < offsets[:-1])[0]) + 1
            raise InputError(f"{name} decrease at index {i}: {int(offsets[i])} < {int(offsets[i - 1])}")
        if int(offsets[-1]) != total:
            raise InputError(f"{name}[-1] {int(offsets[-1])} != number of tokens ({total})")


def validate_gather(truth, truth_lens, req_pool_indices, prefix_lens, extend_offsets, input_ids, out, shift):
    check_tensor("truth", truth, torch.int32, 2)
    check_tensor("truth_lens", truth_lens, torch.int64, 1)
    check_tensor("req_pool_indices", req_pool_indices, torch.int64, 1)
    check_tensor("prefix_lens", prefix_lens, torch.int64, 1)
    check_tensor("extend_offsets", extend_offsets, torch.int64, 1)
    check_tensor("input_ids", input_ids, torch.int64, 1)
    check_tensor("out", out, torch.int64, 1)
    device = check_same_device(truth=truth, truth_lens=truth_lens, req_pool_indices=req_pool_indices,
                               prefix_lens=prefix_lens, extend_offsets=extend_offsets, input_ids=input_ids, out=out)
    check_table("truth", truth)
    for name, t in (("truth_lens", truth_lens), ("req_pool_indices", req_pool_indices), ("prefix_lens", prefix_lens),
                    ("extend_offsets", extend_offsets), ("input_ids", input_ids), ("out", out)):
        check_contiguous(name, t)
    bs, n = req_pool_indices.shape[0], input_ids.shape[0]
    check_len("truth_lens", truth_lens, bs, "bs")
    check_len("prefix_lens", prefix_lens, bs, "bs")
    check_len("out", out, n, "len(input_ids)")
    validate_offsets("extend_offsets", extend_offsets, bs, n)
    if isinstance(shift, bool) or not isinstance(shift, int):
        raise InputTypeError(f"shift must be an int (0, or 1 for speculative drafts), got {type(shift).__name__} "
                             f"{shift!r}")
    if shift not in (0, 1):
        raise InputError(f"shift {shift} not in (0, 1); use 1 only for speculative drafts")
    check_no_alias("out", out, dict(truth=truth, truth_lens=truth_lens, req_pool_indices=req_pool_indices,
                                    prefix_lens=prefix_lens, extend_offsets=extend_offsets, input_ids=input_ids))
    if is_host(req_pool_indices):
        bad = (req_pool_indices < 0) | (req_pool_indices >= truth.shape[0])
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise InputError(f"req_pool_indices[{i}] = {int(req_pool_indices[i])} out of range [0, {truth.shape[0]})")
    return device


def _gather_torch(truth, truth_lens, req_pool_indices, prefix_lens, extend_offsets, input_ids, out, shift):
    n, bs = input_ids.shape[0], req_pool_indices.shape[0]
    if n == 0:
        return
    if bs == 0:
        out.copy_(input_ids)
        return
    rows, width = truth.shape
    t = torch.arange(n, device=input_ids.device)
    r = searchsorted_right(extend_offsets[1:], t)
    rc = r.clamp(max=bs - 1)
    start = extend_offsets[rc]
    row = req_pool_indices[rc]
    p = prefix_lens[rc] + (t - start) + shift
    ok = ((r < bs) & (start <= t) & (t < extend_offsets[rc + 1]) & (row >= 1) & (row < rows)
          & (p >= 0) & (p < truth_lens[rc]) & (p < width))
    vals = truth[row.clamp(0, rows - 1), p.clamp(0, width - 1)].to(torch.int64)
    out.copy_(torch.where(ok, vals, input_ids))


@triton.jit
def _gather_kernel(truth_ptr, tlen_ptr, rpi_ptr, prefix_ptr, off_ptr, ids_ptr, out_ptr, n, bs, rows, width,
                   truth_stride, shift, NBITS: tl.constexpr, BLOCK: tl.constexpr):
    """Lane i of program p handles token t = p*BLOCK + i: binary-search its request r, then read
    truth[rpi[r], prefix_lens[r] + t - off[r] + shift] when in range, else input_ids[t]."""
    pid = tl.program_id(0).to(tl.int64)
    t = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    live = t < n
    r = find_segment(off_ptr + 1, t, bs, NBITS)
    has_r = live & (r < bs)
    start = tl.load(off_ptr + r, mask=has_r, other=0)
    end = tl.load(off_ptr + r + 1, mask=has_r, other=0)
    row = tl.load(rpi_ptr + r, mask=has_r, other=0)
    p = tl.load(prefix_ptr + r, mask=has_r, other=0) + (t - start) + shift
    tlen = tl.load(tlen_ptr + r, mask=has_r, other=0)
    ok = has_r & (start <= t) & (t < end) & (row >= 1) & (row < rows) & (p >= 0) & (p < tlen) & (p < width)
    truth = tl.load(truth_ptr + row * truth_stride + p, mask=ok, other=0).to(tl.int64)
    ids = tl.load(ids_ptr + t, mask=live, other=0)
    tl.store(out_ptr + t, tl.where(ok, truth, ids), mask=live)


def gather_expected_tokens(*, truth: torch.Tensor, truth_lens: torch.Tensor, req_pool_indices: torch.Tensor,
                           prefix_lens: torch.Tensor, extend_offsets: torch.Tensor, input_ids: torch.Tensor,
                           out: torch.Tensor | None = None, shift: int = 0,
                           backend: Backend = Backend.AUTO) -> torch.Tensor:
    """Fill and return ``out`` (int64[T], allocated when None) with each written token's truth.

    Raises TypeError for wrong dtypes, ValueError for wrong ranks/lengths, a shift other than 0
    or 1, and (host tensors only) bad offsets or rows.
    """
    if out is None and isinstance(input_ids, torch.Tensor):
        out = torch.empty_like(input_ids)
    device = validate_gather(truth, truth_lens, req_pool_indices, prefix_lens, extend_offsets, input_ids, out,
                             shift)
    if use_triton(backend, device):
        n, bs = input_ids.shape[0], req_pool_indices.shape[0]
        block = 1024
        _gather_kernel[(max(cdiv(n, block), 1),)](
            truth, truth_lens, req_pool_indices, prefix_lens, extend_offsets, input_ids, out, n, bs,
            truth.shape[0], truth.shape[1], truth.stride(0), shift, NBITS=num_bits(bs), BLOCK=block, num_warps=4)
    else:
        _gather_torch(truth, truth_lens, req_pool_indices, prefix_lens, extend_offsets, input_ids, out, shift)
    return out
