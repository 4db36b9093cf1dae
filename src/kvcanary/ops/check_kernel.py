"""The Triton kernel of ``check_forward`` (``ops.check``, whose module doc gives the mapping from
tickets to work): ticket 0's write offsets and held marks, the verifiers (with their share of
the write targets' marks), the writers' stamp, marks and fingerprints, and the look-back that
carries the chain across write blocks."""

from __future__ import annotations

from kvcanary.ops._common import tl, triton
from kvcanary.ops._jit import find_segment, seg_add
from kvcanary.ops.conflicts import advance_epoch, conflict_lanes, epoch_key, mark_slots
from kvcanary.ops.fingerprint import fold_sources
from kvcanary.ops.landed import landed_lanes, mark_lanes
from kvcanary.ops.plan import _translate
from kvcanary.ops.publish import publish_row
from kvcanary.ops.stamp import block_links, block_targets, stamp_lanes
from kvcanary.ops.verify import check_entries


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
def _mark_written(loc_ptr, woff_ptr, lut_ptr, marks_ptr, mkey, share, shares, n, bs, num_slots, lut_len,
                  HAS_LUT: tl.constexpr, NBITS: tl.constexpr, BLOCK: tl.constexpr):
    """``check_writes``' marks of the written tokens (writers): the blocks of BLOCK tokens
    ``share``, ``share + shares``, ... (verifier ``share`` of ``shares``, once the write offsets are in)."""
    lane = tl.arange(0, BLOCK).to(tl.int64)
    for c in range(share * BLOCK, n, shares * BLOCK):
        t = c + lane
        live = t < n
        slot = tl.load(loc_ptr + t, mask=live, other=0)
        if HAS_LUT:
            slot = _translate(slot, lut_ptr, lut_len, True)
        mark_slots(marks_ptr, slot, live & (find_segment(woff_ptr + 1, t, bs, NBITS) < bs), t, mkey, num_slots, 0)


@triton.jit
def _mark_held(held_ptr, marks_ptr, mkey, n_held, num_slots, BLOCK: tl.constexpr):
    """``check_writes``' marks of the held slots (readers, row 0). ``n_held`` < 0: the held slots
    counted (``held_words``), -n_held words: the count, then the slots."""
    lane = tl.arange(0, BLOCK).to(tl.int64)
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
    after ``max_spins`` polls without progress; returns (carry, done). A flag is this launch's
    where ``f - epoch4`` (int64, wrapping) is 1, 2 or 3: a flag of an earlier launch is 4 or more
    below, whatever the epoch's value, so the epoch word may run past 2**61 (where ``4 * epoch``
    wraps) and 2**63."""
    carry = tl.zeros((), dtype=tl.uint64)
    go = b >= 0
    spins = tl.zeros((), dtype=tl.int64)
    while go & (spins < max_spins):
        f = tl.atomic_add(flag_ptr + b, 0, sem="acquire")
        spins += 1
        d = f - epoch4
        if (d > 0) & (d < 4):  # the aggregate (slot 2b) or, once published, the inclusive sum (slot 2b + 1)
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
        r, has, start, ids, pos, lk = block_links(woff_ptr, ids_ptr, pos_ptr, t, live, bs, NBITS)
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
        loc, slot, row = block_targets(loc_ptr, lut_ptr, rpi_ptr, t, live, r, has, lut_len, HAS_LUT)
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
    pre = tl.full((), 1, tl.int64) << 32  # ticket 0's count in the pre-phase word: the write offsets are in
    mkey = epoch_key(tl.atomic_add(mepoch_ptr, 0))  # read before the last program out advances it
    if (ticket < 0) | (ticket >= grid):  # a stale workspace: this program has no role
        tl.atomic_or(err_ptr, 4)
    elif ticket == 0:
        if STAMP:
            _offsets(rpi_ptr, prefix_ptr, extend_ptr, rtt_ptr, lut_ptr, woff_ptr, seed_ptr, bs, rows, max_ctx,
                     rtt_stride, lut_len, HAS_LUT, 1024)
            _mark_held(held_ptr, marks_ptr, mkey, n_held, num_slots, 1024)
        if SCATTER:  # the ends of the truth offsets, as the scatter's first program checks them
            ends = ((tl.load(toff_ptr) != 0) | (tl.load(toff_ptr + bs) != n_tids)).to(tl.int32)
            if ends != 0:
                tl.atomic_or(err_ptr, ends, sem="relaxed")
        tl.atomic_add(stats_ptr + tag * 3 + 0, 1)
        tl.debug_barrier()
        if STAMP:  # counted held slots: consumed, their count read before the barrier
            tl.store(held_ptr, 0, mask=n_held < 0)
        tl.atomic_add(sync_ptr + 1, pre, sem="release")  # the write offsets are in
    elif ticket <= n_verify:
        v = ticket - 1
        _verify_request(words_ptr, rpi_ptr, prefix_ptr, rtt_ptr, lut_ptr, truth_ptr, tlen_ptr, ring_ptr, counter_ptr,
                        marks_ptr, mkey, stats_ptr, w0_ptr, w1_ptr, w2_ptr, w3_ptr, meta_ptr, tags_ptr, halves,
                        v // split, v % split,
                        split, rows,
                        max_ctx, rtt_stride, lut_len, truth_stride, truth_width, window, num_slots, ring_cap, tag,
                        tids_ptr, toff_ptr, tstarts_ptr, n_tids, err_ptr,
                        HAS_LUT, HAS_TRUTH, VERIFY_SOURCES, BLOCK_V, BLOCK_W, STAMP, SCATTER, HAS_STARTS)
        if STAMP:  # this verifier's share of the writers' marks, once ticket 0 has the write offsets
            ready = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
            spins = tl.zeros((), dtype=tl.int64)
            while (ready < pre) & (spins < max_spins):  # bounded: a stale count must not hang the stream
                ready = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
                spins += 1
            if ready >= pre:
                _mark_written(loc_ptr, woff_ptr, lut_ptr, marks_ptr, mkey, v, n_verify, n, bs, num_slots, lut_len,
                              HAS_LUT, NBITS, 1024)
            else:
                tl.atomic_or(err_ptr, 4)
        tl.debug_barrier()
        tl.atomic_add(sync_ptr + 1, 1, sem="release")
    else:
        done = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
        spins = tl.zeros((), dtype=tl.int64)
        while (done < n_verify + pre) & (spins < max_spins):  # bounded: a stale count must not hang the stream
            done = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
            spins += 1
        if done == n_verify + pre:
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
        if STAMP:  # the marks' next epoch (a restart of the marks once every 2**32 - 1 launches)
            advance_epoch(marks_ptr, mepoch_ptr, mkey, num_slots)
        if PUBLISH:  # every other program has counted: the block as of this launch's end
            publish_row(counter_ptr, pub_seq_ptr, pub_rows_ptr, pub_num_rows, PUB_W, PUB_BLOCK, FENCE)
