"""check_forward: a whole HEAD or TAIL of one forward in a single launch, straight from the page table.

HEAD (``stamp=True``) = ``build_plan`` + ``verify`` + ``check_writes`` + ``gather_expected_tokens`` +
``stamp`` + ``mark_writes`` into the sources (HEAD reads no K/V: its verify checks no fingerprint);
TAIL (``stamp=False``) = ``build_plan`` + ``verify`` with fingerprints + ``check_writes_landed`` +
``fingerprint(record=True)`` of the written slots that landed (translated through ``lut``). The
results are those of that sequence, byte for byte (rows in the ring in any order), with one
difference: there is no plan, so nothing overflows and every prefix entry is checked whatever
its count.

| argument          | dtype / shape        | meaning                                               |
|-------------------|----------------------|-------------------------------------------------------|
| state             | DeviceState          | records read, written (stamp / record); ring, stats   |
| req_pool_indices  | int64[bs]            | page-table row per request; row 0 = padding           |
| prefix_lens       | int64[bs]            | positions already cached (read)                       |
| extend_lens       | int64[bs]            | tokens this forward writes                            |
| req_to_token      | int32[rows, max_ctx] | page table                                            |
| input_ids         | int64[T]             | tokens written, request after request                 |
| positions         | int64[T]             | their positions                                       |
| out_cache_loc     | int64[T]             | their slots                                           |
| truth, truth_lens | int32[rows, w], int64[bs] | token history per row (optional)                 |
| lut, window       | int64[n], int        | sliding-window pool: slot translation, window (0 = full) |

One launch, ``1 + bs * split + cdiv(T, B)`` programs (B = ``WRITE_BLOCK``, 256 tokens, for HEAD; 128 for TAIL).
Programs take tickets from a device counter in the order they start (``Workspace.sync``), so
waiting on a lower ticket cannot deadlock: ticket 0 computes the write offsets and seeds, the next
``bs * split`` tickets verify request ``r`` (split ``s`` walks positions ``lo + s*V, lo + (s +
split)*V, ...``), and the rest
handle B written tokens each. Writers wait until every verifier is done (so a verifier never
sees a record this forward writes), then continue the chain across blocks with a decoupled
look-back over per-block sums (a flag per block: aggregate ready, with or without a segment start,
or inclusive prefix ready; tagged with a per-launch epoch, so nothing is reset between launches;
aggregate and inclusive sum in separate words, so a reader never takes one for the other).
The last program to finish bumps the epoch and, in a launch that publishes (``BoundCheck`` with a
``publication``, called with ``publish=True``: an eager TAIL), copies the counter block into the
publication's rows as ``ops.publish.publish_counters`` would after the launch. The workspace
holds no data between launches beyond the epoch: one ``Workspace`` per stream of launches.
"""

from __future__ import annotations

import operator

import torch

from kvcanary.core.record import LaunchPoint, record_words
from kvcanary.errors import InputError, InputTypeError, KVCanaryError
from kvcanary.ops import _cpu
from kvcanary.ops._common import (
    Backend,
    Validated,
    cdiv,
    check_contiguous,
    check_len,
    check_same_device,
    check_table,
    check_tensor,
    is_host,
    num_bits,
    tl,
    triton,
    use_triton,
    vector_ok,
)
from kvcanary.ops._cpu import use_numba
from kvcanary.ops._jit import find_segment, link64, seg_add
from kvcanary.ops._ring import validate_ring
from kvcanary.ops.conflicts import (
    WriteMarks,
    check_writes,
    conflict_lanes,
    counted_held,
    epoch_key,
    mark_slots,
    validate_held_words,
    validate_marks,
)
from kvcanary.ops.fingerprint import (
    FingerprintMode,
    block_words,
    fingerprint,
    fold_sources,
    source_halves,
    source_words,
    validate_meta,
    validate_sources,
)
from kvcanary.ops.gather import gather_expected_tokens
from kvcanary.ops.landed import check_writes_landed, landed_lanes, mark_lanes, mark_writes
from kvcanary.ops.launcher import Fixed, launch_typed
from kvcanary.ops.plan import Plan, _translate, _translate_torch, build_plan, check_window, validate_batch
from kvcanary.ops.publish import publish_row, validate_publication
from kvcanary.ops.stamp import stamp as stamp_op
from kvcanary.ops.stamp import stamp_lanes
from kvcanary.ops.state import COUNTER_BLOCK_WORDS, WRITE_BLOCK, DeviceState, Workspace, check_state
from kvcanary.ops.verify import check_entries, verify

RECORD_BLOCK = 128
MAX_SPLIT = 1024  # programs per request verifying its prefix
TARGET_PROGRAMS = 1024
_SYNC_TICKET, _SYNC_PRE_DONE, _SYNC_FINISHED, _SYNC_EPOCH = range(4)
# HEAD's programs verify, mark the prefix slots they read and stamp: with 8 warps a decode HEAD
# took 21-31 % less time on an H200 at bs 1 and bs 256 (the same at bs 64); TAIL keeps 4
HEAD_WARPS = 8


_VALIDATED = Validated()  # the batch a state last checked: its TAIL skips what its HEAD checked


def validate_check(state, req_pool_indices, prefix_lens, extend_lens, req_to_token, input_ids, positions,
                   out_cache_loc, truth, truth_lens, lut, window, tag, stamp, sources, mode):
    tag = validate_ring(state, tag)
    canary = state.records
    if not isinstance(mode, FingerprintMode):
        raise InputTypeError(f"mode must be a FingerprintMode, got {mode!r}")
    batch = (req_pool_indices, prefix_lens, extend_lens, req_to_token, input_ids, positions, out_cache_loc, truth,
             truth_lens, lut)
    if not _VALIDATED.seen(state, batch, (window,)):
        _validate_forward(canary, *batch, window)
        _VALIDATED.remember(state, batch, (window,))
    validate_sources(sources, canary.shape[0], state.device)
    workspace = state.workspace(LaunchPoint.HEAD if stamp else LaunchPoint.TAIL)
    if workspace is not None:
        bs = req_pool_indices.shape[0]
        if workspace.max_bs < bs:
            raise InputError(f"state workspace max_bs {workspace.max_bs} < bs ({bs}); allocate the state with "
                             "DeviceState.allocate(..., max_bs=...) of at least the batch size")
        n = input_ids.shape[0]
        if workspace.max_tokens < n:
            raise InputError(f"state workspace max_tokens {workspace.max_tokens} < len(input_ids) ({n}); allocate "
                             "the state with DeviceState.allocate(..., max_tokens=...) of at least the tokens written")
    return tag, workspace


def _validate_forward(canary, req_pool_indices, prefix_lens, extend_lens, req_to_token, input_ids, positions,
                      out_cache_loc, truth, truth_lens, lut, window) -> None:
    """The batch's checks: dtypes, shapes, devices, layouts; on the host its values."""
    for name, t in (("input_ids", input_ids), ("positions", positions), ("out_cache_loc", out_cache_loc)):
        check_tensor(name, t, torch.int64, 1)
    n = input_ids.shape[0]
    check_len("positions", positions, n, "len(input_ids)")
    check_len("out_cache_loc", out_cache_loc, n, "len(input_ids)")
    validate_batch(req_pool_indices, prefix_lens, extend_lens, req_to_token, truth, truth_lens, lut, window)
    check_same_device(records=canary, req_pool_indices=req_pool_indices, input_ids=input_ids,
                      positions=positions, out_cache_loc=out_cache_loc)
    if is_host(extend_lens):
        total = int(extend_lens.numpy().sum())
        if total != n:
            raise InputError(f"extend_lens sum {total} != len(input_ids) ({n})")
    for name, t in (("req_pool_indices", req_pool_indices), ("prefix_lens", prefix_lens),
                    ("extend_lens", extend_lens), ("input_ids", input_ids), ("positions", positions),
                    ("out_cache_loc", out_cache_loc), ("truth_lens", truth_lens), ("lut", lut)):
        if t is not None:
            check_contiguous(name, t)
    for name, t in (("req_to_token", req_to_token), ("truth", truth)):
        if t is not None and t.numel() and t.stride(1) != 1:
            raise InputError(f"{name} must have unit column stride, got strides {t.stride()}")


# --- torch path: the sequence of ops it replaces -----------------------------------------------

def _check_torch(state, rpi, prefix_lens, extend_lens, rtt, ids, pos, loc, truth, truth_lens, lut, window, tag, stamp,
                 sources, mode, meta, held):
    canary = state.records
    bs, (rows, max_ctx) = rpi.shape[0], rtt.shape
    active = (rpi >= 1) & (rpi < rows)
    p_end = prefix_lens.clamp(0, max_ctx)
    lo = (p_end - window).clamp(min=0) if window else torch.zeros_like(p_end)
    entries = int(torch.where(active, p_end - lo, torch.zeros_like(p_end)).sum()) if bs else 0
    plan = Plan.allocate(max(entries, 1), max(bs, 1), canary.device)
    build_plan(req_pool_indices=rpi, prefix_lens=prefix_lens, extend_lens=extend_lens, req_to_token=rtt, plan=plan,
               truth=truth, truth_lens=truth_lens, lut=lut, window=window, backend=Backend.TORCH)
    verify(state=state, plan=plan, tag=tag, sources=() if stamp else sources, mode=mode, meta=meta,
           backend=Backend.TORCH)
    woff = plan.write_offsets[: bs + 1]
    if stamp:
        check_writes(state=state, plan=plan, out_cache_loc=loc, input_ids=ids, positions=pos, req_pool_indices=rpi,
                     write_offsets=woff, tag=tag, lut=lut, held=held, backend=Backend.TORCH)
        expected = None
        if truth is not None:
            expected = gather_expected_tokens(truth=truth, truth_lens=truth_lens, req_pool_indices=rpi,
                                              prefix_lens=prefix_lens, extend_offsets=woff, input_ids=ids,
                                              backend=Backend.TORCH)
        stamp_op(state=state, out_cache_loc=loc, input_ids=ids, positions=pos, req_pool_indices=rpi,
                 prefix_lens=prefix_lens, write_offsets=woff, seed=plan.seed[:bs], tag=tag, expected_tokens=expected,
                 lut=lut, backend=Backend.TORCH)
        mark_writes(state=state, out_cache_loc=loc, sources=sources, lut=lut, backend=Backend.TORCH)
    elif sources:
        landed = check_writes_landed(state=state, out_cache_loc=loc, input_ids=ids, positions=pos, sources=sources,
                                     tag=tag, lut=lut, backend=Backend.TORCH)
        slots = _translate_torch(loc, lut)
        fingerprint(slots=torch.where(landed, slots, torch.zeros_like(slots)), sources=sources, mode=mode,
                    state=state, record=True, meta=meta, backend=Backend.TORCH)


# --- Triton kernel -------------------------------------------------------------------------------

@triton.jit
def _offsets(rpi_ptr, prefix_ptr, extend_ptr, rtt_ptr, lut_ptr, woff_ptr, seed_ptr, bs, rows, max_ctx, rtt_stride,
             lut_len, HAS_LUT: tl.constexpr, BLOCK: tl.constexpr):
    """Write offsets (exclusive sum of clamped extend lengths) and seeds (last prefix slot)."""
    carry = tl.zeros((), dtype=tl.int64)
    for s in range(0, bs, BLOCK):
        j = s + tl.arange(0, BLOCK).to(tl.int64)
        m = j < bs
        row = tl.load(rpi_ptr + j, mask=m, other=0)
        active = m & (row >= 1) & (row < rows)
        row = tl.minimum(tl.maximum(row, 0), rows - 1)
        p_end = tl.minimum(tl.maximum(tl.load(prefix_ptr + j, mask=m, other=0), 0), max_ctx)
        ext = tl.maximum(tl.load(extend_ptr + j, mask=m, other=0), 0)
        tl.store(woff_ptr + j, carry + tl.cumsum(ext, 0) - ext, mask=m)
        last = tl.load(rtt_ptr + row * rtt_stride + tl.maximum(p_end - 1, 0), mask=active, other=0)
        seed = tl.where(active & (p_end > 0), _translate(last, lut_ptr, lut_len, HAS_LUT), -1)
        tl.store(seed_ptr + j, seed, mask=m)
        carry += tl.sum(ext, 0)
    tl.store(woff_ptr + bs, carry)


@triton.jit
def _scatter_around(tids_ptr, toff_ptr, tstarts_ptr, n_tids, truth_ptr, tlen_ptr, err_ptr, raw_row, r, s, split,
                    rows, truth_stride, truth_width, skip_lo, skip_hi, BLOCK: tl.constexpr,
                    HAS_STARTS: tl.constexpr):
    """Request r's part of the truth scatter (``scatter_req_token_ids``) that split s of its
    verifiers makes: truth[row, a + q] = tids[start + q] for q < cnt, a = starts[r] (HAS_STARTS,
    appends; else 0, whole histories), outside the columns [skip_lo, skip_hi) (the positions its
    own verify loop scatters, each just before it reads them); split 0 writes the request's
    length (a + its segment) and raises its error flags, as the scatter's program for r does.
    Returns (start - a: the segment's index of column 0, a, a + cnt, the length)."""
    start = tl.load(toff_ptr + r)
    end = tl.load(toff_ptr + r + 1)
    first = tl.zeros_like(start)
    if HAS_STARTS:
        first = tl.load(tstarts_ptr + r)
    ok = (start >= 0) & (start <= end) & (end <= n_tids) & (raw_row >= 0) & (raw_row < rows) & (first >= 0)
    cnt = tl.where(ok, tl.maximum(tl.minimum(end - start, truth_width - first), 0), 0)
    if s == 0:
        tl.store(tlen_ptr + r, first + end - start)
        code = ((end < start) | (first < 0)).to(tl.int32) + ((raw_row < 0) | (raw_row >= rows)).to(tl.int32) * 2
        if code != 0:
            tl.atomic_or(err_ptr, code, sem="relaxed")
    dst = truth_ptr + tl.minimum(tl.maximum(raw_row, 0), rows - 1) * truth_stride + first
    src = tids_ptr + start
    lane = tl.arange(0, BLOCK).to(tl.int64)
    below = tl.minimum(tl.maximum(skip_lo - first, 0), cnt)  # the segment's part before the skipped columns
    past = tl.minimum(tl.maximum(skip_hi - first, 0), cnt)  # ... and where its part after them begins
    for base in range(s * BLOCK, below, split * BLOCK):
        q = base + lane
        mq = q < below
        tl.store(dst + q, tl.load(src + q, mask=mq, other=0).to(tl.int32), mask=mq)
    above = cnt - past
    for base in range(s * BLOCK, above, split * BLOCK):
        q = past + base + lane
        mq = base + lane < above
        tl.store(dst + q, tl.load(src + q, mask=mq, other=0).to(tl.int32), mask=mq)
    return start - first, first, first + cnt, first + end - start


@triton.jit
def _verify_request(words_ptr, rpi_ptr, prefix_ptr, rtt_ptr, lut_ptr, truth_ptr, tlen_ptr, ring_ptr, counter_ptr,
                    marks_ptr, mkey, stats_ptr, w0_ptr, w1_ptr, w2_ptr, w3_ptr, meta_ptr, tags_ptr, halves, r, s,
                    split, rows,
                    max_ctx, rtt_stride, lut_len, truth_stride, truth_width, window, num_slots, ring_cap, tag,
                    tids_ptr, toff_ptr, tstarts_ptr, n_tids, err_ptr,
                    HAS_LUT: tl.constexpr, HAS_TRUTH: tl.constexpr, NUM_SOURCES: tl.constexpr, BLOCK: tl.constexpr,
                    BLOCK_W: tl.constexpr, MARK: tl.constexpr, SCATTER: tl.constexpr, HAS_STARTS: tl.constexpr):
    """Verify request r's prefix entries of split s: ``verify`` on the entries ``build_plan`` makes;
    with ``SCATTER``, the request's truth scatter first (``_scatter_around``; each position the
    loop verifies is scattered by the same program, lane and thread just before it is read)."""
    raw_row = tl.load(rpi_ptr + r)
    active = (raw_row >= 1) & (raw_row < rows)
    row = tl.minimum(tl.maximum(raw_row, 0), rows - 1)
    p_end = tl.minimum(tl.maximum(tl.load(prefix_ptr + r), 0), max_ctx)
    lo = tl.zeros_like(p_end)
    if window > 0:
        lo = tl.maximum(p_end - window, 0)
    n = tl.where(active, p_end - lo, 0)
    tlen = tl.zeros_like(p_end)
    base_id = tl.zeros_like(p_end)  # the segment's index of column 0: column c's token is tids[base_id + c]
    col_lo = tl.zeros_like(p_end)  # the columns [col_lo, col_hi) the segment writes
    col_hi = tl.zeros_like(p_end)
    if SCATTER:
        base_id, col_lo, col_hi, tlen = _scatter_around(tids_ptr, toff_ptr, tstarts_ptr, n_tids, truth_ptr, tlen_ptr,
                                                        err_ptr, raw_row, r, s, split, rows, truth_stride,
                                                        truth_width, lo, lo + n, BLOCK, HAS_STARTS)
    elif HAS_TRUTH:
        tlen = tl.load(tlen_ptr + r)
    lane = tl.arange(0, BLOCK).to(tl.int64)
    checked = tl.zeros((), dtype=tl.int64)
    for base in range(s * BLOCK, n, split * BLOCK):
        m = base + lane < n
        p = lo + base + lane
        p = tl.minimum(tl.maximum(p, 0), max_ctx - 1)
        if SCATTER:
            sm = m & (p >= col_lo) & (p < col_hi)
            tl.store(truth_ptr + row * truth_stride + p,
                     tl.load(tids_ptr + base_id + p, mask=sm, other=0).to(tl.int32), mask=sm)
        # the plan stores slots, positions and tokens as int32
        entry = tl.load(rtt_ptr + row * rtt_stride + p, mask=m, other=0).to(tl.int64)
        slot = _translate(entry, lut_ptr, lut_len, HAS_LUT)
        slot = slot.to(tl.int32).to(tl.int64)
        if MARK:  # HEAD: the slots this request reads, for the writers' conflict check
            mark_slots(marks_ptr, slot, m, tl.zeros_like(p) + row, mkey, num_slots, 1)
        pred = _translate(tl.load(rtt_ptr + row * rtt_stride + tl.maximum(p - 1, 0), mask=m, other=0),
                          lut_ptr, lut_len, HAS_LUT)
        pred = tl.where(p > 0, pred, -1).to(tl.int32).to(tl.int64)
        etok = tl.full((BLOCK,), -1, dtype=tl.int64)
        if HAS_TRUTH:
            known = m & (p < tlen) & (p < truth_width)
            etok = tl.load(truth_ptr + row * truth_stride + p, mask=known, other=-1).to(tl.int64)
        checked += check_entries(words_ptr, tags_ptr, slot, pred, p, etok, entry, tl.zeros_like(p) + row, m,
                                 num_slots, ring_ptr, counter_ptr, ring_cap, tag, halves, w0_ptr, w1_ptr, w2_ptr,
                                 w3_ptr, meta_ptr, NUM_SOURCES, BLOCK, BLOCK_W)
    tl.atomic_add(stats_ptr + tag * 3 + 1, checked, mask=checked > 0)


@triton.jit
def _mark_writes(loc_ptr, woff_ptr, lut_ptr, held_ptr, marks_ptr, mkey, n, bs, n_held, num_slots, lut_len,
                 HAS_LUT: tl.constexpr, NBITS: tl.constexpr, BLOCK: tl.constexpr):
    """``check_writes``' marks of the written tokens (writers) and of the held slots (readers, row 0).
    ``n_held`` < 0: the held slots counted (``held_words``), -n_held words: the count, then the slots."""
    lane = tl.arange(0, BLOCK).to(tl.int64)
    for c in range(0, n, BLOCK):
        t = c + lane
        live = t < n
        slot = tl.load(loc_ptr + t, mask=live, other=0)
        if HAS_LUT:
            slot = _translate(slot, lut_ptr, lut_len, True)
        mark_slots(marks_ptr, slot, live & (find_segment(woff_ptr + 1, t, bs, NBITS) < bs), t, mkey, num_slots, 0)
    counted = n_held < 0
    count = tl.load(held_ptr, mask=counted, other=0).to(tl.int64)
    count = tl.where(counted, tl.minimum(tl.maximum(count, 0), -n_held - 1), n_held)
    first = counted.to(tl.int64)  # the slots after the count word
    for c in range(0, count, BLOCK):
        i = c + lane
        h = i < count
        mark_slots(marks_ptr, tl.load(held_ptr + first + i, mask=h, other=0), h, tl.zeros_like(i), mkey, num_slots,
                   1)


@triton.jit
def _look_back(sum_ptr, flag_ptr, b, epoch4, max_spins):
    """Carry into write block b + 1: walk back from block b over published aggregates until a
    block that holds a segment start or has its inclusive sum (block 0 always has). Gives up
    after ``max_spins`` polls without progress; returns (carry, done)."""
    carry = tl.zeros((), dtype=tl.uint64)
    go = b >= 0
    spins = tl.zeros((), dtype=tl.int64)
    while go & (spins < max_spins):
        f = tl.atomic_add(flag_ptr + b, 0, sem="acquire")
        spins += 1
        if f > epoch4:  # the aggregate (slot 2b) or, once published, the inclusive sum (slot 2b + 1)
            word = 2 * b + (f == epoch4 + 3).to(tl.int64)
            carry += tl.load(sum_ptr + word, volatile=True).to(tl.uint64, bitcast=True)
            go = (f == epoch4 + 1) & (b > 0)
            b -= 1
            spins = spins * 0
    return carry, go == 0


@triton.jit
def _write_block(words_ptr, rpi_ptr, prefix_ptr, ids_ptr, pos_ptr, loc_ptr, lut_ptr, truth_ptr, tlen_ptr,
                 marks_ptr, mkey, woff_ptr, seed_ptr, sum_ptr, flag_ptr, ring_ptr, counter_ptr, stats_ptr, err_ptr,
                 w0_ptr, w1_ptr,
                 w2_ptr, w3_ptr, meta_ptr, tags_ptr, w, epoch4, max_spins, n, bs, rows, lut_len, truth_stride,
                 truth_width,
                 num_slots, ring_cap, tag, STAMP: tl.constexpr, HAS_LUT: tl.constexpr, HAS_TRUTH: tl.constexpr,
                 NUM_SOURCES: tl.constexpr, HALVES: tl.constexpr, NBITS: tl.constexpr, BLOCK: tl.constexpr,
                 BLOCK_W: tl.constexpr):
    """HEAD: stamp written tokens [w*BLOCK, (w+1)*BLOCK) (``stamp`` with ``gather``'s expected
    tokens) and mark their slots in the sources; TAIL: check the marks are gone, then record the
    fingerprints of the slots that landed. A look-back that gives up (a stale workspace) raises
    the WORKSPACE error flag and leaves its block unstamped and unpublished."""
    block_start = w * BLOCK
    lane = tl.arange(0, BLOCK).to(tl.int64)
    t = block_start + lane
    live = t < n
    if STAMP:
        r = find_segment(woff_ptr + 1, t, bs, NBITS)
        has = live & (r < bs)
        start = tl.load(woff_ptr + r, mask=has, other=0)
        ids = tl.load(ids_ptr + t, mask=live, other=0)
        pos = tl.load(pos_ptr + t, mask=live, other=0)
        lk = tl.where(has, link64(ids, pos), 0)
        is_start = has & (t == start)
        flag = (is_start | (lane == 0)).to(tl.int32)
        _, incl = tl.associative_scan((flag, lk), 0, seg_add)
        excl = incl - lk
        # publish this block's aggregate, then (when its first segment began earlier) look back
        last_start = tl.max(tl.where(is_start, t, block_start), 0)
        agg = tl.sum(tl.where(t >= last_start, lk, 0), 0)
        any_start = tl.max(is_start.to(tl.int64), 0)
        r0 = tl.min(r, 0)
        s0 = tl.load(woff_ptr + tl.minimum(r0, bs), mask=r0 < bs, other=block_start)
        open_seg = (r0 < bs) & (s0 < block_start)
        carry = tl.zeros((), dtype=tl.uint64)
        found = w >= 0
        if w > 0:
            tl.atomic_xchg(sum_ptr + 2 * w, agg.to(tl.int64, bitcast=True))
            tl.debug_barrier()
            tl.atomic_xchg(flag_ptr + w, epoch4 + 1 + any_start, sem="release")
            if open_seg | (any_start == 0):
                carry, found = _look_back(sum_ptr, flag_ptr, w - 1, epoch4, max_spins)
        if found:
            inclusive = tl.where(any_start != 0, agg, carry + agg)
            tl.atomic_xchg(sum_ptr + 2 * w + 1, inclusive.to(tl.int64, bitcast=True))
            tl.debug_barrier()
            tl.atomic_xchg(flag_ptr + w, epoch4 + 3, sem="release")
        else:
            tl.atomic_or(err_ptr, 4)
        has = tl.where(found != 0, has, tl.zeros_like(has))
        excl += tl.where((r == r0) & open_seg, carry, 0)
        loc = tl.load(loc_ptr + t, mask=live, other=0)
        slot = loc
        if HAS_LUT:
            slot = _translate(loc, lut_ptr, lut_len, True)
        row = tl.load(rpi_ptr + r, mask=has, other=0)
        exp_tok = ids
        if HAS_TRUTH:  # gather_expected_tokens, inline
            p_w = tl.load(prefix_ptr + r, mask=has, other=0) + (t - start)
            end = tl.load(woff_ptr + r + 1, mask=has, other=0)
            tlen = tl.load(tlen_ptr + r, mask=has, other=0)
            known = has & (start <= t) & (t < end) & (row >= 1) & (row < rows) & (p_w >= 0) \
                & (p_w < tlen) & (p_w < truth_width)
            exp_tok = tl.where(known, tl.load(truth_ptr + row * truth_stride + p_w, mask=known, other=0).to(tl.int64),
                               ids)
        conflict_lanes(marks_ptr, woff_ptr, rpi_ptr, ring_ptr, counter_ptr, ring_cap, tag, mkey, t, has, slot, row, pos,
                       ids, bs, num_slots, NBITS)
        stamp_lanes(words_ptr, seed_ptr, prefix_ptr, r, has, t, start, ids, pos, excl, loc, slot, row, exp_tok,
                    num_slots, ring_ptr, counter_ptr, ring_cap, stats_ptr, tag)
        if NUM_SOURCES > 0:
            mark_lanes(slot, live & (slot > 0) & (slot < num_slots), w0_ptr, w1_ptr, w2_ptr, w3_ptr, meta_ptr,
                       NUM_SOURCES)
    elif NUM_SOURCES > 0:
        for c in range(0, tl.minimum(n - block_start, BLOCK), 32):  # 32 rows at a time: a [32, BLOCK_W] tile

            tc = block_start + c + tl.arange(0, 32).to(tl.int64)
            lc = tc < n
            slot = _translate(tl.load(loc_ptr + tc, mask=lc, other=0), lut_ptr, lut_len, HAS_LUT)
            ok = lc & (slot > 0) & (slot < num_slots)
            ok = ok & landed_lanes(slot, ok, tl.load(pos_ptr + tc, mask=lc, other=0), tl.load(ids_ptr + tc, mask=lc,
                                                                                             other=0),
                                   w0_ptr, w1_ptr, w2_ptr, w3_ptr, meta_ptr, ring_ptr, counter_ptr, ring_cap, tag,
                                   NUM_SOURCES, HALVES)
            h, tags = fold_sources(slot, ok, w0_ptr, w1_ptr, w2_ptr, w3_ptr, meta_ptr, NUM_SOURCES, 32, BLOCK_W)
            tl.store(words_ptr + slot * 4 + 3, h.to(tl.int64, bitcast=True), mask=ok)
            tl.store(tags_ptr + slot, tags.to(tl.int64, bitcast=True), mask=ok)


# every integer argument varies with the batch: specialising on them would compile a variant per shape
@triton.jit(do_not_specialize=["n", "bs", "rows", "max_ctx", "rtt_stride", "lut_len", "truth_stride", "truth_width",
                               "window", "num_slots", "ring_cap", "tag", "split", "n_verify", "grid",
                               "max_spins", "n_held", "halves", "n_tids"])
def _check_kernel(words_ptr, ring_ptr, counter_ptr, stats_ptr, err_ptr, sync_ptr, woff_ptr, seed_ptr, sum_ptr,
                  flag_ptr, marks_ptr, mepoch_ptr, w0_ptr, w1_ptr, w2_ptr, w3_ptr, meta_ptr, tags_ptr, halves,
                  window, num_slots, ring_cap, max_spins, pub_seq_ptr, pub_rows_ptr, pub_num_rows,
                  rpi_ptr, prefix_ptr, extend_ptr, rtt_ptr, lut_ptr, truth_ptr, tlen_ptr, ids_ptr, pos_ptr, loc_ptr,
                  held_ptr, tids_ptr, toff_ptr, tstarts_ptr, n, bs, rows, max_ctx, rtt_stride, lut_len, truth_stride,
                  truth_width,
                  tag, split, n_verify, grid, n_held, n_tids, STAMP: tl.constexpr, HAS_LUT: tl.constexpr,
                  HAS_TRUTH: tl.constexpr, NUM_SOURCES: tl.constexpr, VERIFY_SOURCES: tl.constexpr,
                  HALVES: tl.constexpr, NBITS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_W: tl.constexpr,
                  BLOCK_T: tl.constexpr, PUBLISH: tl.constexpr, PUB_W: tl.constexpr, PUB_BLOCK: tl.constexpr,
                  FENCE: tl.constexpr, SCATTER: tl.constexpr, HAS_STARTS: tl.constexpr):
    ticket = tl.atomic_add(sync_ptr + 0, 1)
    if ticket == grid - 1:  # every program holds its ticket: ready for the next launch
        tl.atomic_xchg(sync_ptr + 0, 0)
    epoch4 = tl.atomic_add(sync_ptr + 3, 0) * 4
    mkey = epoch_key(tl.atomic_add(mepoch_ptr, 0))  # read before the last program out advances it
    if (ticket < 0) | (ticket >= grid):  # a stale workspace: this program has no role
        tl.atomic_or(err_ptr, 4)
    elif ticket == 0:
        if STAMP:
            _offsets(rpi_ptr, prefix_ptr, extend_ptr, rtt_ptr, lut_ptr, woff_ptr, seed_ptr, bs, rows, max_ctx,
                     rtt_stride, lut_len, HAS_LUT, 1024)
            tl.debug_barrier()
            _mark_writes(loc_ptr, woff_ptr, lut_ptr, held_ptr, marks_ptr, mkey, n, bs, n_held, num_slots, lut_len,
                         HAS_LUT, NBITS, 1024)
        if SCATTER:  # the ends of the truth offsets, as the scatter's first program checks them
            ends = ((tl.load(toff_ptr) != 0) | (tl.load(toff_ptr + bs) != n_tids)).to(tl.int32)
            if ends != 0:
                tl.atomic_or(err_ptr, ends, sem="relaxed")
        tl.atomic_add(stats_ptr + tag * 3 + 0, 1)
        tl.debug_barrier()
        if STAMP:  # counted held slots: consumed, their count read before the barrier
            tl.store(held_ptr, 0, mask=n_held < 0)
        tl.atomic_add(sync_ptr + 1, 1, sem="release")
    elif ticket <= n_verify:
        v = ticket - 1
        _verify_request(words_ptr, rpi_ptr, prefix_ptr, rtt_ptr, lut_ptr, truth_ptr, tlen_ptr, ring_ptr, counter_ptr,
                        marks_ptr, mkey, stats_ptr, w0_ptr, w1_ptr, w2_ptr, w3_ptr, meta_ptr, tags_ptr, halves,
                        v // split, v % split,
                        split, rows,
                        max_ctx, rtt_stride, lut_len, truth_stride, truth_width, window, num_slots, ring_cap, tag,
                        tids_ptr, toff_ptr, tstarts_ptr, n_tids, err_ptr,
                        HAS_LUT, HAS_TRUTH, VERIFY_SOURCES, BLOCK_V, BLOCK_W, STAMP, SCATTER, HAS_STARTS)
        tl.debug_barrier()
        tl.atomic_add(sync_ptr + 1, 1, sem="release")
    else:
        done = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
        spins = tl.zeros((), dtype=tl.int64)
        while (done < n_verify + 1) & (spins < max_spins):  # bounded: a stale count must not hang the stream
            done = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
            spins += 1
        if done == n_verify + 1:
            _write_block(words_ptr, rpi_ptr, prefix_ptr, ids_ptr, pos_ptr, loc_ptr, lut_ptr, truth_ptr, tlen_ptr,
                         marks_ptr, mkey, woff_ptr, seed_ptr, sum_ptr, flag_ptr, ring_ptr, counter_ptr, stats_ptr,
                         err_ptr, w0_ptr,
                         w1_ptr, w2_ptr, w3_ptr, meta_ptr, tags_ptr, ticket - 1 - n_verify, epoch4, max_spins, n,
                         bs, rows,
                         lut_len, truth_stride, truth_width, num_slots, ring_cap, tag, STAMP, HAS_LUT, HAS_TRUTH,
                         NUM_SOURCES, HALVES, NBITS, BLOCK_T, BLOCK_W)
        else:  # the verifiers never all reported (or more did than exist): a stale workspace
            tl.atomic_or(err_ptr, 4)
    tl.debug_barrier()
    finished = tl.atomic_add(sync_ptr + 2, 1, sem="acq_rel")
    if finished == grid - 1:  # the last one out: reset the counters, open the next epoch
        tl.atomic_xchg(sync_ptr + 2, 0)
        tl.atomic_xchg(sync_ptr + 1, 0)
        tl.atomic_add(sync_ptr + 3, 1, sem="release")
        if STAMP:
            tl.atomic_add(mepoch_ptr, 1, sem="release")
        if PUBLISH:  # every other program has counted: the block as of this launch's end
            publish_row(counter_ptr, pub_seq_ptr, pub_rows_ptr, pub_num_rows, PUB_W, PUB_BLOCK, FENCE)


def _held_arg(held: torch.Tensor | None, counted: bool = False) -> int:
    """The kernel's ``n_held`` for ``held`` (slots), or for ``held_words`` where ``counted``: minus its length."""
    if held is None:
        return 0
    return -held.shape[0] if counted else held.shape[0]


def verify_split(bs: int, max_ctx: int, block: int) -> int:
    """Programs per request: enough to fill ~TARGET_PROGRAMS programs, no more than a full row needs."""
    return max(1, min(cdiv(max_ctx, block), cdiv(TARGET_PROGRAMS, max(bs, 1))))


def check_forward(*, state: DeviceState, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                  extend_lens: torch.Tensor, req_to_token: torch.Tensor, input_ids: torch.Tensor,
                  positions: torch.Tensor, out_cache_loc: torch.Tensor, tag: int, stamp: bool,
                  truth: torch.Tensor | None = None, truth_lens: torch.Tensor | None = None, sources=(),
                  mode: FingerprintMode = FingerprintMode.NONE, meta: torch.Tensor | None = None,
                  lut: torch.Tensor | None = None, window: int = 0, split: int | None = None,
                  max_spins: int | None = None, marks: WriteMarks | None = None, held: torch.Tensor | None = None,
                  held_words: torch.Tensor | None = None, backend: Backend = Backend.AUTO) -> None:
    """HEAD (``stamp=True``) or TAIL (``stamp=False``) of one forward (see module doc) on ``state``.
    Never raises on values; raises InputTypeError / InputError for wrong dtypes, shapes, devices,
    sources, meta, tag or a state whose workspace is too small, before anything is written. The
    kernel uses the state's HEAD or TAIL workspace (a fresh one per call when the state has none,
    which is not capturable). ``split``: programs per request verifying its prefix (None:
    ``verify_split`` on CUDA, 1 elsewhere, where the Triton interpreter runs programs one by one);
    the results do not depend on it. ``max_spins``: polls a waiting program makes before it gives
    up and raises ``DeviceFlag.WORKSPACE`` in ``state.error`` (None: 2**24 on CUDA, seconds of
    waiting; 64 elsewhere, where the interpreter runs programs in ticket order and never waits).
    HEAD also checks the write targets (``ops.conflicts``): ``marks`` is its scratch (allocated per
    call when None, which is not capturable), ``held`` the idle prefix-cache slots, or
    ``held_words`` the same counted (``ops.conflicts``: the count, then the slots; HEAD reads the
    count on the device and sets it to 0, so a captured HEAD checks each replay's holds once). With
    ``sources``, HEAD marks every write target in each source and TAIL reports the targets still
    marked as MISSED_WRITE and records no fingerprint for them (``ops.landed``); HEAD checks no
    fingerprint."""
    sources = list(sources) if mode is not FingerprintMode.NONE else []
    tag, workspace = validate_check(state, req_pool_indices, prefix_lens, extend_lens, req_to_token, input_ids,
                                    positions, out_cache_loc, truth, truth_lens, lut, window, tag, stamp, sources,
                                    mode)
    device = state.device
    meta = validate_meta(meta, sources, mode, device)
    validate_marks(marks, held, state.num_slots, device)
    validate_held_words(held_words, held, device)
    _check_split(split, max_spins)
    counted = stamp and held_words is not None
    if counted and not use_triton(backend, device):
        held = counted_held(held_words)
    if use_numba(backend, device):
        _cpu.check(state, req_pool_indices, prefix_lens, extend_lens, req_to_token, input_ids, positions,
                   out_cache_loc, truth, truth_lens, lut, held if stamp else None, tag, stamp, sources, meta, window)
        if counted:
            held_words[:1].zero_()
        return
    if not use_triton(backend, device):
        _check_torch(state, req_pool_indices, prefix_lens, extend_lens, req_to_token, input_ids, positions,
                     out_cache_loc, truth, truth_lens, lut, window, tag, stamp, sources, mode, meta,
                     held if stamp else None)
        if counted:
            held_words[:1].zero_()
        return
    if workspace is None:
        workspace = Workspace.allocate(max(req_pool_indices.shape[0], 1), max(input_ids.shape[0], 1), device)
    if stamp and marks is None:
        marks = WriteMarks.allocate(state.num_slots, device)
    _CheckLaunch(state, workspace, stamp, sources, mode, meta, marks, window, split, max_spins).launch(
        req_pool_indices, prefix_lens, extend_lens, req_to_token, input_ids, positions, out_cache_loc, truth,
        truth_lens, lut, held_words if counted else held if stamp else None, tag, counted=counted)


def _check_split(split, max_spins) -> None:
    if split is not None and (isinstance(split, bool) or not isinstance(split, int) or not 1 <= split <= MAX_SPLIT):
        raise InputError(f"split {split!r} out of range [1, {MAX_SPLIT}]; pass None (verify_split) or a positive int")
    if max_spins is not None and (isinstance(max_spins, bool) or not isinstance(max_spins, int)
                                  or not 1 <= max_spins < 2**62):
        raise InputError(f"max_spins {max_spins!r} out of range [1, 2**62); pass None for the default")


class _CheckLaunch:
    """The Triton launch of ``check_forward`` on arguments it has validated: everything but the
    batch, the tag and the held slots fixed at construction (``BoundCheck`` keeps one)."""

    def __init__(self, state: DeviceState, workspace: Workspace, stamp: bool, sources: list, mode: FingerprintMode,
                 meta, marks, window: int, split: int | None, max_spins: int | None, publication: tuple | None = None):
        ws = workspace
        self.publication = publication  # (seq, rows), validated: a launch may publish the counter block
        fp_sources = [] if stamp else sources  # HEAD verifies no fingerprint; it marks the write targets
        # TAIL without fingerprints: 256 a verify program (16-20 % faster than 512 at large decode shapes)
        self.block_v = {FingerprintMode.NONE: 1024, FingerprintMode.PARTIAL: 256, FingerprintMode.ALL: 32}[mode] \
            if fp_sources else 512 if stamp else 256
        self.cuda = state.device.type == "cuda"
        self.split, self.num_warps = split, HEAD_WARPS if stamp else 4
        self.sync = ws.sync
        self.block_t = WRITE_BLOCK if stamp else RECORD_BLOCK  # HEAD: 256 tokens a program; TAIL: 128 fingerprints
        self.writers = stamp or bool(sources)
        self.seed = ws.seed
        max_spins = max_spins if max_spins is not None else 1 << 24 if self.cuda else 64
        # the kernel's leading arguments, the same at every launch: keyed once (ops.launcher.Fixed)
        self.fixed = Fixed(_check_kernel, (
            record_words(state.records), state.ring, state.ring_counter, state.stats, state.error, ws.sync,
            ws.write_offsets, ws.seed, ws.block_sum, ws.block_flag, marks.words if stamp else ws.sync,
            marks.epoch if stamp else ws.sync, *source_words(sources, ws.seed), meta if meta is not None else ws.sync,
            state.source_tags, source_halves(fp_sources), window, state.num_slots, state.ring_capacity, max_spins,
            *(publication if publication is not None else (ws.sync, ws.sync)),
            publication[1].shape[0] if publication is not None else 1))
        self.constexprs = dict(
            STAMP=stamp, HAS_LUT=False, HAS_TRUTH=False, NUM_SOURCES=len(sources), VERIFY_SOURCES=len(fp_sources),
            HALVES=source_halves(sources),
            NBITS=num_bits(ws.max_bs),  # the workspace's capacity, not bs: one variant for every batch size
            BLOCK_V=self.block_v, BLOCK_W=block_words(fp_sources, mode) if fp_sources else 4, BLOCK_T=self.block_t,
            PUBLISH=False, PUB_W=COUNTER_BLOCK_WORDS, PUB_BLOCK=triton.next_power_of_2(COUNTER_BLOCK_WORDS),
            FENCE=self.cuda, SCATTER=False, HAS_STARTS=False)
        self._variants: dict = {}  # a launch's variant -> its constexprs (``_constexprs``)
        self._splits: dict = {}  # (bs, max_ctx) -> ``verify_split``'s programs a request

    def launch(self, rpi, prefix_lens, extend_lens, rtt, ids, pos, loc, truth, truth_lens, lut, held, tag,
               publish: bool = False, truth_ids=None, truth_offsets=None, truth_starts=None,
               counted: bool = False) -> None:
        """``counted``: ``held`` is ``check_forward``'s ``held_words``."""
        rows, max_ctx = rtt.shape
        self.launch_laid(self.tensors(rpi, prefix_lens, extend_lens, rtt, ids, pos, loc, truth, truth_lens, lut, held,
                                      truth_ids, truth_offsets, truth_starts),
                         lut is not None, truth is not None, _held_arg(held, counted), tag,
                         (ids.shape[0], rpi.shape[0], rows, max_ctx, rtt.stride(0), lut.shape[0] if lut is not None
                          else 0), publish=publish, n_tids=truth_ids.shape[0] if truth_ids is not None else -1,
                         starts=truth_starts is not None)

    def launch_laid(self, tensors: tuple, has_lut: bool, has_truth: bool, held: int, tag: int, laid: tuple,
                    addresses: list | None = None, publish: bool = False, n_tids: int = -1,
                    starts: bool = False) -> None:
        """``launch`` of ``tensors`` (``tensors()``) with the batch's sizes read already: ``held`` is
        the kernel's ``n_held`` (``_held_arg``); ``laid`` is
        (n, bs, rows, max_ctx, rtt.stride(0), len(lut) or 0); ``addresses``: the tensors'
        ``data_ptr()``, where the caller read them; ``publish``: the last program out publishes
        the counter block (``publication``, bound); ``n_tids`` >= 0: HEAD scatters the truth
        ``tensors()`` holds (that many tokens) into the truth table first, as appends from the
        start columns it holds where ``starts``, else as whole histories."""
        # memo lookups and arithmetic written out, not calls: between a model's launches each Python
        # call costs µs
        n, bs = laid[0], laid[1]
        split = self.split
        if split is None:
            split = self._splits.get((bs, laid[3]))
            if split is None:
                split = self._splits[bs, laid[3]] = verify_split(bs, laid[3], self.block_v) if self.cuda else 1
        n_verify = bs * split
        grid = 1 + n_verify + (-(-n // self.block_t) if self.writers else 0)  # cdiv
        truth_t = tensors[5]  # the truth table, or the page table in its place
        scatter = n_tids >= 0
        variant = (has_lut, has_truth, held != 0, publish, scatter, starts)
        constexprs = self._variants.get(variant)
        if constexprs is None:
            constexprs = self._constexprs(has_lut, has_truth, publish, scatter, starts)
        launch_typed(_check_kernel, (grid,), tensors,
                     (*laid, truth_t.stride(0), truth_t.shape[1], tag, split, n_verify, grid,
                      held, n_tids if scatter else 0),
                     variant, constexprs, num_warps=self.num_warps, fixed=self.fixed, addresses=addresses)

    def tensors(self, rpi, prefix_lens, extend_lens, rtt, ids, pos, loc, truth, truth_lens, lut, held,
                truth_ids=None, truth_offsets=None, truth_starts=None) -> tuple:
        """The kernel's fourteen per-launch tensors, in its order (an absent one's place taken by a
        tensor of the same dtype the kernel does not read)."""
        return (rpi, prefix_lens, extend_lens, rtt, lut if lut is not None else self.seed,
                truth if truth is not None else rtt, truth_lens if truth_lens is not None else prefix_lens,
                ids, pos, loc, held if held is not None else self.sync,
                truth_ids if truth_ids is not None else prefix_lens,
                truth_offsets if truth_offsets is not None else prefix_lens,
                truth_starts if truth_starts is not None else prefix_lens)

    def _constexprs(self, has_lut: bool, has_truth: bool, publish: bool = False, scatter: bool = False,
                    starts: bool = False) -> dict:
        """The constexprs of a launch with these flags, kept in ``_variants`` under the launch's variant
        (the flags and whether slots are held, which changes no constexpr: both keys share one dict)."""
        c = {**self.constexprs, "HAS_LUT": has_lut, "HAS_TRUTH": has_truth, "PUBLISH": publish, "SCATTER": scatter,
             "HAS_STARTS": starts}
        for held in (False, True):
            c = self._variants.setdefault((has_lut, has_truth, held, publish, scatter, starts), c)
        return c


class BatchMemo:
    """The device batch the bound checks sharing this memo (one canary's) last found laid out as
    their kernel reads it (``BoundCheck._sizes``): the same tensor objects, at the same
    addresses, pass again with the sizes read then, without their dtypes, shapes and strides read
    again (a forward's HEAD and TAIL get the same batch). An in-place change of a tensor's storage
    moves its address; one that keeps the address keeps the memory the sizes were checked
    against. Holds the tensors, so their memory cannot go to a new tensor while remembered."""

    __slots__ = ("batch", "lut", "index", "addresses", "sizes")

    # the batch's places in ``_CheckLaunch.tensors``: rpi, prefix_lens, extend_lens, req_to_token,
    # then lut (when there is one), then input_ids, positions, out_cache_loc
    _TABLE, _LUT, _TOKENS = slice(0, 4), 4, slice(7, 10)

    def __init__(self):
        self.batch: tuple | None = None
        self.lut = self.index = self.addresses = self.sizes = None

    def holds(self, batch: tuple, lut, index: int) -> bool:
        """Whether ``batch`` (and ``lut``) are the tensor objects remembered, for the same device."""
        last = self.batch
        return last is not None and lut is self.lut and index == self.index and all(map(operator.is_, batch, last))

    def laid(self, addresses: list, lut) -> tuple | None:
        """The remembered sizes (n, bs, rows, max_ctx, rtt.stride(0), len(lut) or 0) where the
        held batch's tensors are at the addresses remembered (``addresses``: its
        ``_CheckLaunch.tensors`` addresses now); else None."""
        if (addresses[self._TABLE] != self.addresses[0] or addresses[self._TOKENS] != self.addresses[1]
                or (lut is not None and addresses[self._LUT] != self.addresses[2])):
            return None
        return self.sizes

    def remember(self, batch: tuple, lut, addresses: list, index: int, sizes: tuple) -> None:
        """Remember ``batch``, laid out as the kernel reads it, and its ``sizes``."""
        self.batch, self.lut, self.index, self.sizes = batch, lut, index, sizes
        self.addresses = (addresses[self._TABLE], addresses[self._TOKENS], addresses[self._LUT])


_ADDRESS = torch.Tensor.data_ptr


class BoundCheck:
    """``check_forward`` at one launch point of one state with the caller's own arguments bound
    once (a Canary on CUDA: the state and its workspace, sources, meta, mode, window, write marks,
    truth table): on a device the per-call checks shrink to a few attribute reads. What
    ``check_forward`` checks splits:

    | what                                                   | checked                            |
    |--------------------------------------------------------|------------------------------------|
    | the bound arguments                                    | once, here: its errors, raised     |
    | the state's buffers, the tag                           | every call (the tag once per value)|
    | a batch's dtypes, ranks, lengths, device, contiguity, | every call, as reads that return   |
    | table layout, its fit in the workspace                 | False instead of raising           |
    | a device batch's values (rows, lengths, offsets)       | by the kernel, which masks, flags  |
    | a host batch                                           | ``check_forward``'s own checks     |

    A call returns False having launched nothing for a batch it does not take; the caller then
    runs ``check_forward`` (after ``scatter_req_token_ids`` for a batch's token truth), which
    raises the error that names the argument. Triton only (CUDA, or the CPU under the
    interpreter).

    ``publication``: (seq, rows) of ``ops.publish`` for the state's counter block, checked here; a
    call with ``publish=True`` then publishes the block from its last program out, after every
    other program of the launch has counted: the launch and ``publish_counters`` after it in one
    (an eager TAIL hands ``end_step`` its counters without a launch of their own).

    HEAD with the bound truth table also takes a batch's token truth (``truth_ids``,
    ``truth_offsets`` and, for appends, ``truth_starts``: ``scatter_req_token_ids``' ``flat_in``,
    ``offsets`` and ``starts``) and scatters it into the table and its lengths inside its own
    launch: ``scatter_req_token_ids`` then the check, in one launch. Each verifier program
    scatters its request's positions, those it verifies just before it reads them; the writers
    wait for every verifier, as before. Two requests on one page-table row leave the row as
    unspecified as the scatter does."""

    def __init__(self, state: DeviceState, *, stamp: bool, sources=(), mode: FingerprintMode = FingerprintMode.NONE,
                 meta: torch.Tensor | None = None, window: int = 0, marks: WriteMarks | None = None,
                 truth: torch.Tensor | None = None, truth_lens: torch.Tensor | None = None,
                 split: int | None = None, max_spins: int | None = None, memo: BatchMemo | None = None,
                 publication: tuple[torch.Tensor, torch.Tensor] | None = None):
        check_state(state)
        if not isinstance(mode, FingerprintMode):
            raise InputTypeError(f"mode must be a FingerprintMode, got {mode!r}")
        device = state.device
        sources = list(sources) if mode is not FingerprintMode.NONE else []
        validate_sources(sources, state.num_slots, device)
        meta = validate_meta(meta, sources, mode, device)
        check_window(window)
        workspace = state.workspace(LaunchPoint.HEAD if stamp else LaunchPoint.TAIL)
        if workspace is None:
            raise InputError("BoundCheck needs a state with workspaces; allocate it with "
                             "DeviceState.allocate(..., max_bs=..., max_tokens=...)")
        if stamp and marks is None:
            marks = WriteMarks.allocate(state.num_slots, device)
        validate_marks(marks, None, state.num_slots, device)
        if (truth is None) != (truth_lens is None):
            raise InputError("truth and truth_lens go together: pass both or neither")
        if truth is not None:
            check_tensor("truth", truth, torch.int32, 2)
            check_table("truth", truth)
            check_tensor("truth_lens", truth_lens, torch.int64, 1)
            check_contiguous("truth_lens", truth_lens)
            check_same_device(records=state.records, truth=truth, truth_lens=truth_lens)
            if truth_lens.shape[0] < workspace.max_bs:
                raise InputError(f"truth_lens length {truth_lens.shape[0]} < the workspace's max_bs "
                                 f"({workspace.max_bs}); one length per request of the largest batch")
        _check_split(split, max_spins)
        if memo is not None and not isinstance(memo, BatchMemo):
            raise InputTypeError(f"memo must be a BatchMemo or None, got {type(memo).__name__}")
        if publication is not None:
            if type(publication) is not tuple or len(publication) != 2:
                got = f"a tuple of {len(publication)}" if type(publication) is tuple else type(publication).__name__
                raise InputTypeError(f"publication must be a (seq, rows) tuple or None, got {got}")
            validate_publication(state.counter_block(), *publication)
        self.state, self.stamp, self.window = state, stamp, window
        self.truth, self.truth_lens = truth, truth_lens
        self.max_bs, self.max_tokens = workspace.max_bs, workspace.max_tokens
        self.index = device.index if device.type == "cuda" else -1  # Tensor.get_device() of the state's tensors
        self._tags: set[int] = set()
        self._launch = _CheckLaunch(state, workspace, stamp, sources, mode, meta, marks, window, split, max_spins,
                                    publication)
        self.memo = memo if memo is not None else BatchMemo()

    def __call__(self, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                 req_to_token: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                 out_cache_loc: torch.Tensor, *, tag: int, truth: bool = False, lut: torch.Tensor | None = None,
                 held: torch.Tensor | None = None, publish: bool = False, truth_ids: torch.Tensor | None = None,
                 truth_offsets: torch.Tensor | None = None, truth_starts: torch.Tensor | None = None,
                 held_words: torch.Tensor | None = None) -> bool:
        """HEAD (the bound ``stamp``) or TAIL of one batch, with the bound truth table when
        ``truth``, publishing the counter block when ``publish``, scattering ``truth_ids`` by
        ``truth_offsets`` (from the columns ``truth_starts``, appends, where given) into the truth
        table first (HEAD with ``truth``), checking ``held`` or ``held_words`` (``check_forward``'s);
        True when launched (see the class doc)."""
        if publish is not False and (publish is not True or self._launch.publication is None):
            raise InputError(f"publish must be True or False, got {publish!r}" if publish is not True else
                             "publish=True but this BoundCheck has no publication; bind one with "
                             "BoundCheck(..., publication=(seq, rows))")
        scatter = truth_ids is not None or truth_offsets is not None
        if truth_starts is not None and not scatter:
            raise InputError("truth_starts needs truth_ids and truth_offsets (appends are scattered by HEAD); "
                             "got truth_ids None, truth_offsets None")
        if scatter and (truth_ids is None or truth_offsets is None or not self.stamp or truth is not True):
            raise InputError("truth_ids and truth_offsets go together, to HEAD (stamp=True) with truth=True; got "
                             f"truth_ids {'set' if truth_ids is not None else 'None'}, truth_offsets "
                             f"{'set' if truth_offsets is not None else 'None'}, stamp={self.stamp}, truth={truth!r}")
        state = self.state
        state.check()
        if tag not in self._tags:
            validate_ring(state, tag)  # raises for a tag out of range, as check_forward does
            if type(tag) is int:
                self._tags.add(tag)
        if truth and self.truth is None:
            return False
        truth_t = self.truth if truth else None
        truth_lens = self.truth_lens if truth else None
        batch = (req_pool_indices, prefix_lens, extend_lens, req_to_token, input_ids, positions, out_cache_loc)
        if held is not None and (not self.stamp or not isinstance(held, torch.Tensor)
                                 or not vector_ok(held, held.shape[0], self.index)):
            return False
        counted = held_words is not None
        if counted:
            if (held is not None or not self.stamp or not isinstance(held_words, torch.Tensor)
                    or not vector_ok(held_words, held_words.shape[0], self.index) or held_words.shape[0] < 1):
                return False
            held = held_words
        if scatter and not self._scatter_ok(req_pool_indices, truth_ids, truth_offsets, truth_starts):
            return False
        if self.index < 0:  # a host batch: check_forward's value checks
            if not self._layout_ok(batch, lut, truth) or not self._host_ok(batch, truth_t, truth_lens, lut):
                return False
            laid, addresses = None, None
        else:
            memo, tensors = self.memo, None
            if memo.holds(batch, lut, self.index):
                tensors = self._launch.tensors(*batch, truth_t, truth_lens, lut, held, truth_ids, truth_offsets,
                                               truth_starts)
                addresses = list(map(_ADDRESS, tensors))
                laid = memo.laid(addresses, lut)
            else:
                laid = None
            if laid is None:
                laid = self._sizes(batch, lut, truth)
                if laid is None:
                    return False
                if tensors is None:
                    tensors = self._launch.tensors(*batch, truth_t, truth_lens, lut, held, truth_ids, truth_offsets,
                                                   truth_starts)
                    addresses = list(map(_ADDRESS, tensors))
                memo.remember(batch, lut, addresses, self.index, laid)
            elif laid[1] > self.max_bs or laid[0] > self.max_tokens or (truth and self.truth.shape[0] != laid[2]):
                return False
        # the whole lengths buffer: the kernel reads the first bs (check_forward's slice, without a view a call)
        if laid is None:
            self._launch.launch(*batch, truth_t, truth_lens, lut, held, tag, publish, truth_ids, truth_offsets,
                                truth_starts, counted)
        else:
            self._launch.launch_laid(tensors, lut is not None, truth, _held_arg(held, counted), tag, laid,
                                     addresses, publish, truth_ids.shape[0] if scatter else -1,
                                     truth_starts is not None)
        return True

    def _layout_ok(self, batch: tuple, lut, truth: bool = False) -> bool:
        return self._sizes(batch, lut, truth) is not None

    def _scatter_ok(self, rpi, truth_ids, truth_offsets, truth_starts) -> bool:
        """Whether a batch's token truth is laid out as the kernel's scatter reads it."""
        index = self.index
        return (isinstance(truth_ids, torch.Tensor) and truth_ids.dim() == 1
                and vector_ok(truth_ids, truth_ids.shape[0], index) and isinstance(rpi, torch.Tensor)
                and vector_ok(truth_offsets, rpi.shape[0] + 1, index)
                and (truth_starts is None or vector_ok(truth_starts, rpi.shape[0], index)))

    def takes(self, batch: tuple, truth: bool = False, truth_ids=None, truth_offsets=None,
              truth_starts=None) -> tuple | None:
        """(n, bs, rows, max_ctx) of ``batch`` (rpi, prefix_lens, extend_lens, req_to_token,
        input_ids, positions, out_cache_loc) where a call would take its layout, with the bound
        truth table when ``truth`` and scattering its token truth where ``truth_ids`` is given
        (no lut); None where it would not. Reads attributes only: checks no value, launches
        nothing (the fixed buffers of ``runtime.eager_graphs`` are loaded from batches it takes)."""
        if truth and self.truth is None:
            return None
        laid = self._sizes(batch, None, truth)
        if laid is None or (truth_ids is not None and not self._scatter_ok(batch[0], truth_ids, truth_offsets,
                                                                          truth_starts)):
            return None
        return laid[:4]

    def _sizes(self, batch: tuple, lut, truth: bool = False) -> tuple | None:
        """(n, bs, rows, max_ctx, rtt.stride(0), len(lut) or 0) of a batch laid out as the kernel
        reads it (dtypes, ranks, lengths, device, contiguity, table layout, its fit in the
        workspace and the truth table); None for one it does not take."""
        rpi, prefix_lens, extend_lens, rtt, ids, pos, loc = batch
        index = self.index
        if not isinstance(rpi, torch.Tensor) or not isinstance(ids, torch.Tensor) or rpi.dim() != 1 or ids.dim() != 1:
            return None
        bs, n = rpi.shape[0], ids.shape[0]
        if bs > self.max_bs or n > self.max_tokens:
            return None
        for t, length in ((rpi, bs), (prefix_lens, bs), (extend_lens, bs), (ids, n), (pos, n), (loc, n)):
            if not vector_ok(t, length, index):
                return None
        if lut is not None and not (isinstance(lut, torch.Tensor) and vector_ok(lut, lut.shape[0], index)
                                    and lut.shape[0] >= 1):
            return None
        if (not isinstance(rtt, torch.Tensor) or rtt.dtype is not torch.int32 or rtt.dim() != 2
                or rtt.get_device() != index):
            return None
        rows, width = rtt.shape
        if rows < 1 or width < 1 or (width > 1 and rtt.stride(1) != 1) or (rows > 1 and rtt.stride(0) < width):
            return None
        if truth and self.truth.shape[0] != rows:
            return None
        return n, bs, rows, width, rtt.stride(0), lut.shape[0] if lut is not None else 0

    def _host_ok(self, batch: tuple, truth, truth_lens, lut) -> bool:
        checked = (*batch[:7], truth, truth_lens[: batch[0].shape[0]] if truth_lens is not None else None, lut)
        if not _VALIDATED.seen(self.state, checked, (self.window,)):
            try:
                _validate_forward(self.state.records, *checked, self.window)
            except KVCanaryError:
                return False
            _VALIDATED.remember(self.state, checked, (self.window,))
        return True

