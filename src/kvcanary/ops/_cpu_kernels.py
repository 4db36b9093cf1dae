"""The compiled CPU kernels' source (numba, compiled by ``ops._cpu`` on first use): a whole
HEAD or TAIL of ``check_forward`` (``_check``) and a plan's ``verify`` (``_verify``), with the
functions they call (the truth scatter's: ``_cpu_scatter``). Plain Python until ``ops._cpu.kernel``
compiles them: the called functions become numba functions in this module's namespace first,
so the kernels compile against them. Each kernel reproduces its torch path byte for byte (see
``ops._cpu``); ``*_SIG`` are their signatures, ``INLINED`` / ``CALLED`` how the rest compiles.
"""

from __future__ import annotations

import numpy as np

from kvcanary.core.hashing import ANCHOR, GOLDEN, MIX1, MIX2, TOKEN_SALT
from kvcanary.ops._cpu_scatter import _scatter_bad, _scatter_rows
from kvcanary.ops.fingerprint import FP_SEED
from kvcanary.ops.landed import MARK_SEED

_M1, _M2, _GOLDEN, _SALT, _FP_SEED, _MARK_SEED = (np.uint64(x) for x in (MIX1, MIX2, GOLDEN, TOKEN_SALT, FP_SEED,
                                                                         MARK_SEED))
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_ANCHOR_S = np.int64(ANCHOR - (1 << 64) if ANCHOR >> 63 else ANCHOR)
_LOW32, _LOW16, _UNMARKED = np.uint64(0xFFFFFFFF), np.uint64(0xFFFF), np.int64(2**63 - 1)
# reason bits (core.record.Reason)
_CHAIN, _POSITION, _FINGERPRINT, _WRITE_TOKEN, _WRITE_POSITION, _VERIFY_TOKEN = 1, 2, 4, 8, 16, 32
_BAD_ENTRY, _WRITE_CONFLICT, _READ_CONFLICT, _MISSED_WRITE = 64, 128, 256, 512
# flags of the check kernel
_STAMP, _TRUTH, _LUT, _HELD, _SCATTER, _STARTS = 1, 2, 4, 8, 16, 32


def _mix(z):
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


def _link(token, position):
    """``core.hashing.link`` of int64 token and position, as uint64."""
    h = _mix(np.uint64(token) ^ _SALT)
    return _mix(h ^ (np.uint64(position) * _GOLDEN))


def _translate(s, via_lut, has_lut, n_lut):
    """``plan._translate_torch`` of slot s: through the LUT of ``n_lut`` entries (-1 outside it),
    then 0 -> -1. ``via_lut``: ``lut[_in_lut(s, n_lut)]``, read by the caller: an array passed to
    an inlined function costs reference-count updates at every call (in the page-table walks,
    half of their time)."""
    if has_lut:
        s = via_lut if 0 <= s < n_lut else np.int64(-1)
    return np.int64(-1) if s == 0 else np.int64(s)


def _in_lut(s, n_lut):
    """s clamped into a LUT of ``n_lut`` >= 1 entries: the entry ``_translate`` reads, or ignores."""
    return min(max(s, np.int64(0)), n_lut - 1)


def _fingerprints(words, slots, n, out, tags, kv0, kv1, kv2, kv3, meta, num_sources):
    """``fingerprint_torch`` of ``slots[:n]`` into ``out`` and their side words into ``tags``, which
    hold zeros on entry (slots outside (0, num_slots): left so); the parts are summed in place.
    One call for all entries: every array passed to a called function costs a reference-count
    update, so the arrays cross once, not once per entry; for the same reason the sources are
    the outer loop (one source array picked per source, not per entry and source)."""
    num_slots = words.shape[0]
    total = out.view(np.uint64)
    side = tags.view(np.uint64)
    for i in range(num_sources):
        kv = kv0 if i == 0 else (kv1 if i == 1 else (kv2 if i == 2 else kv3))
        page, stride_w, token_w, n_words = meta[i, 0], meta[i, 1], meta[i, 2], meta[i, 3]
        salt = np.uint64(i + 1) * _GOLDEN
        shift = np.uint64(16 * i)
        for e in range(n):
            s = slots[e]
            if s <= 0 or s >= num_slots:
                continue
            # an integer division costs tens of cycles: token-major pools (page 1) need none
            base = s * stride_w if page == 1 else (s // page) * stride_w + (s % page) * token_w
            if n_words == 4:  # partial: the sum below, unrolled
                acc = ((np.uint64(kv[base]) & _LOW32) + (np.uint64(kv[base + 1]) & _LOW32) * np.uint64(3)
                       + (np.uint64(kv[base + 2]) & _LOW32) * np.uint64(5)
                       + (np.uint64(kv[base + 3]) & _LOW32) * np.uint64(7))
            else:
                acc = np.uint64(0)
                for w in range(n_words):
                    acc += (np.uint64(kv[base + w]) & _LOW32) * np.uint64(2 * w + 1)
            part = _mix(acc * _GOLDEN + salt)
            total[e] += part
            side[e] |= (part & _LOW16) << shift
    for e in range(n):
        s = slots[e]
        if s <= 0 or s >= num_slots:
            continue
        out[e] = np.int64(_mix(total[e] ^ _FP_SEED))


def _append(ring, counter, tag, slot, pos, tok, etok, stored, want, reasons):
    """``_ring.append_violations_torch`` for one row: kept while the ring has room, always counted."""
    k = counter[0]
    if 0 <= k < ring.shape[0]:
        ring[k, 0], ring[k, 1], ring[k, 2], ring[k, 3] = tag, slot, pos, tok
        ring[k, 4], ring[k, 5], ring[k, 6], ring[k, 7] = etok, stored, want, reasons
    counter[0] = k + 1


def _entry_check(tok, spos, chain, fp_stored, qtok, qpos, qchain, pred_ok, p, etok, fp_want, has_fp):
    """The checks of one prefix entry from its slot's record (and its predecessor's, when
    ``pred_ok``): (expected chain, chain bad, any check bad)."""
    exp_chain = np.int64(np.uint64(qchain) + _link(qtok, qpos)) if pred_ok else _ANCHOR_S
    chain_bad = (pred_ok or p == 0) and chain != exp_chain
    bad = chain_bad or spos != p or (etok != -1 and tok != etok) or (has_fp and fp_stored != fp_want)
    return exp_chain, chain_bad, bad


def _report_entry(ring, counter, src_tags, tag, halves, num_sources, s, p, etok, tok, spos, chain, exp_chain,
                  chain_bad, fp_stored, fp_want, exp_tag):
    """The ring row of a prefix entry that failed a check (``verify._verify_torch``): its reasons
    in one row; a FINGERPRINT row's tag names the sources whose part differs from the side word
    in ``src_tags`` (``fingerprint.mismatch_tag_torch``; ``halves``: bit i = source i's half).
    Called only for a failed entry, so the hot loops stay free of its array arguments."""
    pos_bad = spos != p
    tok_bad = etok != -1 and tok != etok
    fp_bad = num_sources > 0 and fp_stored != fp_want
    reasons = (np.int64(chain_bad) * _CHAIN + np.int64(pos_bad) * _POSITION
               + np.int64(fp_bad) * _FINGERPRINT + np.int64(tok_bad) * _VERIFY_TOKEN)
    row_tag = np.int64(tag)
    if fp_bad:  # the half of the first source whose part differs (the first source's when none)
        diff = src_tags[s] ^ exp_tag
        mask = np.int64(0)
        half = np.int64(halves & 1)
        for i in range(num_sources - 1, -1, -1):
            if (diff >> (16 * i)) & 0xFFFF != 0:
                mask |= np.int64(1) << i
                half = np.int64((halves >> i) & 1)
        row_tag = (np.int64(tag) & ~np.int64(1)) | half | (mask << 8)
    if chain_bad:
        _append(ring, counter, row_tag, s, spos, tok, etok, chain, exp_chain, reasons)
    elif pos_bad:
        _append(ring, counter, row_tag, s, spos, tok, etok, spos, p, reasons)
    elif fp_bad:
        _append(ring, counter, row_tag, s, spos, tok, etok, fp_stored, fp_want, reasons)
    else:
        _append(ring, counter, row_tag, s, spos, tok, etok, tok, etok, reasons)


def _verify_entries(words, slot, pred, position, token, entry, prow, m, ring, counter, stats, tag, kv0, kv1, kv2,
                    kv3, meta, num_sources, src_tags, halves):
    """``verify._verify_torch`` of a plan's entries [0, m): one launch, the checked count, ring rows
    in entry order (``_report_entry``). The loop reads arrays itself and calls only scalar
    functions (see ``_fingerprints``)."""
    num_slots = words.shape[0]
    stats[tag, 0] += 1
    k = m if num_sources > 0 else 0
    fps = np.zeros(k, dtype=np.int64)
    exp_tags = np.zeros(k, dtype=np.int64)
    if num_sources > 0:
        _fingerprints(words, slot, m, fps, exp_tags, kv0, kv1, kv2, kv3, meta, num_sources)
    checked = 0
    for e in range(m):
        s, q, p, etok = np.int64(slot[e]), np.int64(pred[e]), np.int64(position[e]), np.int64(token[e])
        if s == 0:
            continue
        checked += 1
        if s < 0 or s >= num_slots:  # an unresolvable entry: BAD_ENTRY naming the entry and its row
            _append(ring, counter, tag, np.int64(entry[e]), p, -1, etok, np.int64(prow[e]), s, _BAD_ENTRY)
            continue
        qq = q if 0 < q < num_slots else 0  # slot 0: a row to read when there is no predecessor
        fp_want = fps[e] if num_sources > 0 else np.int64(0)
        exp_chain, chain_bad, bad = _entry_check(words[s, 0], words[s, 1], words[s, 2], words[s, 3], words[qq, 0],
                                                 words[qq, 1], words[qq, 2], qq > 0, p, etok, fp_want, num_sources > 0)
        if bad:
            _report_entry(ring, counter, src_tags, tag, halves, num_sources, s, p, etok, words[s, 0], words[s, 1],
                          words[s, 2], exp_chain, chain_bad, words[s, 3], fp_want,
                          exp_tags[e] if num_sources > 0 else np.int64(0))
    stats[tag, 1] += checked


def _verify_prefixes(words, rpi, lo, hi, rtt, truth, tlens, lut, scratch, ring, counter, stats, tag, kv0, kv1, kv2,
                     kv3, meta, num_sources, src_tags, halves, has_truth, has_lut, mark_readers):
    """``build_plan`` + ``verify`` of each request's prefix entries [lo[r], hi[r]) in one walk of the
    page table, without building the plan: request after request (the plan's entry order, so the
    ring rows come in the same order), slots and predecessors through the LUT and cut to int32 as
    the plan stores them. With ``num_sources`` the fingerprints are checked too, each distinct slot
    folded once (requests that share a prefix read the same slots; a fingerprint depends on the
    slot's K/V bytes alone): ``scratch[0, s]`` holds s's index among them meanwhile, then
    _UNMARKED again. ``mark_readers`` (HEAD): ``scratch[1, s]`` becomes the smallest row reading
    s, for ``_writes`` (``_unmark_readers`` clears it)."""
    num_slots, bs, width, n_lut = words.shape[0], rpi.shape[0], truth.shape[1], lut.shape[0]
    stats[tag, 0] += 1
    k = 0
    m = 0
    if num_sources > 0:
        for r in range(bs):
            m += hi[r] - lo[r]
    distinct = np.empty(m, dtype=np.int64)
    for r in range(bs if num_sources > 0 else 0):
        row = rpi[r]
        for p in range(lo[r], hi[r]):
            raw = np.int64(rtt[row, p])
            s = np.int64(np.int32(_translate(raw, lut[_in_lut(raw, n_lut)], has_lut, n_lut)))
            if 0 < s < num_slots and scratch[0, s] == _UNMARKED:
                scratch[0, s] = k
                distinct[k] = s
                k += 1
    dfp = np.zeros(k, dtype=np.int64)
    dtags = np.zeros(k, dtype=np.int64)
    _fingerprints(words, distinct, k, dfp, dtags, kv0, kv1, kv2, kv3, meta, num_sources)
    checked = 0
    for r in range(bs):
        row = rpi[r]
        tlen = tlens[r] if has_truth else 0
        prev = np.int64(-1)
        if lo[r] > 0:
            raw = np.int64(rtt[row, lo[r] - 1])
            prev = _translate(raw, lut[_in_lut(raw, n_lut)], has_lut, n_lut)
        for p in range(lo[r], hi[r]):
            raw = np.int64(rtt[row, p])
            cur = _translate(raw, lut[_in_lut(raw, n_lut)], has_lut, n_lut)
            s = np.int64(np.int32(cur))
            q = np.int64(np.int32(prev)) if p > 0 else np.int64(-1)
            prev = cur
            etok = np.int64(truth[row, p]) if has_truth and p < tlen and p < width else np.int64(-1)
            if s == 0:
                continue
            checked += 1
            if s < 0 or s >= num_slots:  # an unresolvable entry: BAD_ENTRY naming the entry and its row
                _append(ring, counter, tag, raw, p, -1, etok, row, s, _BAD_ENTRY)
                continue
            if mark_readers and row < scratch[1, s]:
                scratch[1, s] = row
            qq = q if 0 < q < num_slots else 0
            d = scratch[0, s] if num_sources > 0 else 0  # s's index among the distinct slots
            fp_want = dfp[d] if num_sources > 0 else np.int64(0)
            exp_chain, chain_bad, bad = _entry_check(words[s, 0], words[s, 1], words[s, 2], words[s, 3],
                                                     words[qq, 0], words[qq, 1], words[qq, 2], qq > 0, p, etok,
                                                     fp_want, num_sources > 0)
            if bad:
                _report_entry(ring, counter, src_tags, tag, halves, num_sources, s, p, etok, words[s, 0],
                              words[s, 1], words[s, 2], exp_chain, chain_bad, words[s, 3], fp_want,
                              dtags[d] if num_sources > 0 else np.int64(0))
    for j in range(k):
        scratch[0, distinct[j]] = _UNMARKED
    stats[tag, 1] += checked


def _unmark_readers(num_slots, rpi, lo, hi, rtt, lut, has_lut, scratch):
    """Clear the reader marks ``_verify_prefixes(mark_readers=True)`` left in ``scratch[1]``."""
    n_lut = lut.shape[0]
    for r in range(rpi.shape[0]):
        row = rpi[r]
        for p in range(lo[r], hi[r]):
            raw = np.int64(rtt[row, p])
            s = np.int64(np.int32(_translate(raw, lut[_in_lut(raw, n_lut)], has_lut, n_lut)))
            if 0 < s < num_slots:
                scratch[1, s] = _UNMARKED


def _check(words, rpi, prefix, extend, rtt, ids, pos, loc, truth, tlens, flat, offsets, tstarts, lut, held, scratch,
           ring, counter, stats, kv0, kv1, kv2, kv3, meta, src_tags, num_sources, halves, window, tag, flags):
    """``check_forward``'s torch path (see ``ops.check``); ``flags``: _STAMP, _TRUTH, _LUT, _HELD,
    _SCATTER (the forward's truth scatter from ``flat`` / ``offsets`` first: one call for a CPU
    Canary's truth scatter and HEAD), _STARTS (that scatter's segments are appends from
    ``tstarts``).
    Verifies the plan's entries as it walks the page table (``_verify_prefixes``; HEAD: no
    fingerprints), then HEAD checks the write targets, stamps (every seed read before any write) and marks the
    targets in the sources, or TAIL names the targets still marked (MISSED_WRITE) and records the
    fingerprints and side words of the others. ``scratch``: int64[2, num_slots] all _UNMARKED,
    left so. Returns 0, or 1 without touching anything when the batch's values are out of the
    ranges ``check_forward`` accepts (``_batch_ok``: the caller then raises its error)."""
    stamp, has_truth, has_lut = (flags & _STAMP) != 0, (flags & _TRUTH) != 0, (flags & _LUT) != 0
    bs = rpi.shape[0]
    rows, max_ctx = rtt.shape[0], rtt.shape[1]
    if not _batch_ok(rpi, prefix, extend, rows, max_ctx, ids.shape[0], counter) or lut.shape[0] < 1:
        return 1  # (an empty LUT, even an unused one: ``_in_lut`` reads an entry of it)
    if flags & _SCATTER:  # the forward's truth scatter first (``_scatter``, strict), into truth and tlens
        has_starts = (flags & _STARTS) != 0  # appends, each from its start on
        bad_off, bad_rows = _scatter_bad(flat, offsets, rpi, truth.shape[0], tstarts, has_starts)
        if bad_off or bad_rows or tlens.shape[0] < bs:
            return 2
        _scatter_rows(flat, offsets, rpi, truth, tlens, True, tstarts, has_starts)
    lo = np.zeros(bs, dtype=np.int64)  # each request's prefix entries [lo, hi): none for padding rows
    hi = np.zeros(bs, dtype=np.int64)
    for r in range(bs):
        if 1 <= rpi[r] < rows:
            hi[r] = min(max(prefix[r], 0), max_ctx)
            lo[r] = max(hi[r] - window, 0) if window > 0 else 0
    _verify_prefixes(words, rpi, lo, hi, rtt, truth, tlens, lut, scratch, ring, counter, stats, tag, kv0, kv1, kv2,
                     kv3, meta, 0 if stamp else num_sources, src_tags, halves, has_truth, has_lut, stamp)
    if stamp:
        woff = np.zeros(bs + 1, dtype=np.int64)  # build_plan's write offsets: clamped extend lengths
        for r in range(bs):
            woff[r + 1] = woff[r] + max(extend[r], 0)
        _writes(words, rpi, woff, ids, pos, loc, lut, held, scratch, ring, counter, tag, flags)
        _unmark_readers(words.shape[0], rpi, lo, hi, rtt, lut, has_lut, scratch)
        _stamp(words, rpi, prefix, woff, rtt, ids, pos, loc, truth, tlens, lut, ring, counter, stats, tag,
               has_truth, has_lut)
        if num_sources > 0:
            _marks_io(words.shape[0], ids, pos, loc, lut, has_lut, kv0, kv1, kv2, kv3, meta, num_sources, halves,
                      ring, counter, tag, True)
    elif num_sources > 0:  # TAIL: the targets still marked, then the fingerprints of those that landed
        n = ids.shape[0]
        written = _marks_io(words.shape[0], ids, pos, loc, lut, has_lut, kv0, kv1, kv2, kv3, meta, num_sources,
                            halves, ring, counter, tag, False)
        fps = np.zeros(n, dtype=np.int64)
        side = np.zeros(n, dtype=np.int64)
        _fingerprints(words, written, n, fps, side, kv0, kv1, kv2, kv3, meta, num_sources)
        for t in range(n):
            if 0 < written[t] < words.shape[0]:
                words[written[t], 3] = fps[t]
                src_tags[written[t]] = side[t]
    return 0


def _batch_ok(rpi, prefix, extend, rows, max_ctx, n, counter):
    """The host value checks of ``check_forward`` (``plan.validate_batch``: rows in the table,
    prefix and extend lengths inside ``max_ctx``; extend lengths summing to ``n``; a ring counter
    >= 0), so a batch refilled in place since it was checked is refused before anything is
    written; the limits are compared without sums that could wrap."""
    if counter[0] < 0:
        return False
    total = 0
    for r in range(rpi.shape[0]):
        p, e = prefix[r], extend[r]
        if rpi[r] < 0 or rpi[r] >= rows or p < 0 or p > max_ctx or e < 0 or e > max_ctx - p:
            return False
        total += e
    return total == n


def _marks_io(num_slots, ids, pos, loc, lut, has_lut, kv0, kv1, kv2, kv3, meta, num_sources, halves, ring, counter,
              tag, mark):
    """``landed.mark_writes`` (``mark``) or ``check_writes_landed``: the first four int32 words of
    each valid target's row in every source get (or are compared with) the slot's mark. Returns
    the translated slot per token, 0 where it missed (check) or is invalid."""
    n, n_lut = ids.shape[0], lut.shape[0]
    written = np.zeros(n, dtype=np.int64)
    for t in range(n):
        s = _translate(loc[t], lut[_in_lut(loc[t], n_lut)], has_lut, n_lut)
        if not (0 < s < num_slots):
            continue
        b = np.uint64(s) ^ _MARK_SEED
        m0, m1 = _mix(b), _mix(b + _GOLDEN)
        w0, w1 = np.int32(np.uint32(m0 & _LOW32)), np.int32(np.uint32(m0 >> np.uint64(32)))
        w2, w3 = np.int32(np.uint32(m1 & _LOW32)), np.int32(np.uint32(m1 >> np.uint64(32)))
        bits = np.int64(0)
        first = np.int64(-1)
        for i in range(num_sources - 1, -1, -1):  # last to first: the first marked source's half stays
            kv = kv0 if i == 0 else (kv1 if i == 1 else (kv2 if i == 2 else kv3))
            page, stride_w, token_w = meta[i, 0], meta[i, 1], meta[i, 2]
            base = s * stride_w if page == 1 else (s // page) * stride_w + (s % page) * token_w
            if mark:
                kv[base], kv[base + 1], kv[base + 2], kv[base + 3] = w0, w1, w2, w3
            elif kv[base] == w0 and kv[base + 1] == w1 and kv[base + 2] == w2 and kv[base + 3] == w3:
                bits |= np.int64(1) << i
                first = np.int64((halves >> i) & 1)
        if bits != 0:
            _append(ring, counter, (np.int64(tag) & ~np.int64(1)) | first, s, pos[t], ids[t], -1, bits, 0,
                    _MISSED_WRITE)
        else:
            written[t] = s
    return written


def _writes(words, rpi, woff, ids, pos, loc, lut, held, scratch, ring, counter, tag, flags):
    """``conflicts._writes_torch``: WRITE_CONFLICT against the first writer of a slot, READ_CONFLICT
    against the smallest row reading it (held slots: row 0). Rows in token order. ``scratch[0,
    s]``: first writer token, ``scratch[1, s]``: smallest reader row (the plan's readers marked
    by ``_verify_prefixes``); every word touched here is reset to _UNMARKED on return."""
    num_slots, n, bs, n_lut = words.shape[0], ids.shape[0], rpi.shape[0], lut.shape[0]
    if n == 0 or bs == 0:
        return
    has_lut, has_held = (flags & _LUT) != 0, (flags & _HELD) != 0
    if has_held:
        for i in range(held.shape[0]):
            h = held[i]
            if 0 < h < num_slots:
                scratch[1, h] = 0
    row = np.zeros(n, dtype=np.int64)
    r = 0
    for t in range(n):  # the request of token t: the segment [woff[r], woff[r + 1]) holding it
        while r < bs and woff[r + 1] <= t:
            r += 1
        if r < bs:
            row[t] = rpi[r]
        s = _translate(loc[t], lut[_in_lut(loc[t], n_lut)], has_lut, n_lut)
        if r < bs and 0 < s < num_slots and scratch[0, s] == _UNMARKED:
            scratch[0, s] = t
    for t in range(n):
        s = _translate(loc[t], lut[_in_lut(loc[t], n_lut)], has_lut, n_lut)
        if not (0 < s < num_slots) or woff[bs] <= t:
            continue
        f = scratch[0, s]
        dup = f != t
        rd = scratch[1, s] != _UNMARKED
        if dup or rd:
            reasons = np.int64(dup) * _WRITE_CONFLICT + np.int64(rd) * _READ_CONFLICT
            other = row[f] if dup else scratch[1, s]
            _append(ring, counter, tag, s, pos[t], ids[t], -1, row[t], other, reasons)
    for t in range(n):
        s = _translate(loc[t], lut[_in_lut(loc[t], n_lut)], has_lut, n_lut)
        if 0 < s < num_slots:
            scratch[0, s] = _UNMARKED
            scratch[1, s] = _UNMARKED
    if has_held:
        for i in range(held.shape[0]):
            h = held[i]
            if 0 < h < num_slots:
                scratch[1, h] = _UNMARKED


def _stamp(words, rpi, prefix, woff, rtt, ids, pos, loc, truth, tlens, lut, ring, counter, stats, tag, has_truth,
           has_lut):
    """``gather_expected_tokens`` + ``stamp._stamp_torch`` after ``build_plan``'s write offsets and seeds."""
    num_slots, bs, n, n_lut = words.shape[0], rpi.shape[0], ids.shape[0], lut.shape[0]
    if n == 0 or bs == 0:
        return
    rows, max_ctx = rtt.shape[0], rtt.shape[1]
    width = truth.shape[1]
    base = np.empty(bs, dtype=np.uint64)
    seed_pos = np.zeros(bs, dtype=np.int64)
    seed_ok = np.zeros(bs, dtype=np.bool_)
    for r in range(bs):  # every seed is read before any record is written
        row = rpi[r]
        base[r] = np.uint64(_ANCHOR_S)
        p_end = min(max(prefix[r], 0), max_ctx)
        if 1 <= row < rows and p_end > 0:
            raw = np.int64(rtt[row, p_end - 1])
            s = _translate(raw, lut[_in_lut(raw, n_lut)], has_lut, n_lut)
            if 0 < s < num_slots:
                seed_ok[r] = True
                seed_pos[r] = words[s, 1]
                base[r] = np.uint64(words[s, 2]) + _link(words[s, 0], words[s, 1])
    chains = np.empty(n, dtype=np.int64)
    stamped = 0
    for r in range(bs):
        start, end = woff[r], min(woff[r + 1], n)
        row = rpi[r]
        excl = np.uint64(0)
        for t in range(start, end):
            j = t - start
            tid, tpos = ids[t], pos[t]
            chains[t] = np.int64(base[r] + excl)
            excl += _link(tid, tpos)
            if row == 0:  # a padding request: neither stamped nor checked
                continue
            slot = _translate(loc[t], lut[_in_lut(loc[t], n_lut)], True, n_lut) if has_lut else loc[t]
            exp_tok = tid
            if has_truth:
                p = prefix[r] + j
                if 1 <= row < rows and 0 <= p < tlens[r] and p < width:
                    exp_tok = np.int64(truth[row, p])
            exp_pos = prefix[r] + j
            pos_bad = tpos != exp_pos or (seed_ok[r] and j == 0 and seed_pos[r] + 1 != tpos)
            want_pos = exp_pos if tpos != exp_pos else seed_pos[r] + 1
            tok_bad = tid != exp_tok
            bad = not (0 < slot < num_slots)
            if pos_bad or tok_bad or bad:
                reasons = np.int64(pos_bad) * _WRITE_POSITION + np.int64(tok_bad) * _WRITE_TOKEN \
                    + np.int64(bad) * _BAD_ENTRY
                if bad:
                    _append(ring, counter, tag, loc[t], tpos, tid, exp_tok, row, slot, reasons)
                elif pos_bad:
                    _append(ring, counter, tag, slot, tpos, tid, exp_tok, tpos, want_pos, reasons)
                else:
                    _append(ring, counter, tag, slot, tpos, tid, exp_tok, tid, exp_tok, reasons)
    for r in range(bs):  # then the records, in token order
        if rpi[r] == 0:
            continue
        for t in range(woff[r], min(woff[r + 1], n)):
            slot = _translate(loc[t], lut[_in_lut(loc[t], n_lut)], True, n_lut) if has_lut else loc[t]
            if 0 < slot < num_slots:
                words[slot, 0], words[slot, 1], words[slot, 2], words[slot, 3] = ids[t], pos[t], chains[t], 0
                stamped += 1
    stats[tag, 2] += stamped


def _verify(words, slot, pred, position, token, entry, prow, count, enable, ring, counter, stats, kv0, kv1, kv2, kv3,
            meta, src_tags, num_sources, halves, tag):
    """``verify._verify_torch``: the entries below min(count, capacity) of an enabled plan."""
    m = min(max(count[0], 0), slot.shape[0]) if enable[0] != 0 else 0
    _verify_entries(words, slot, pred, position, token, entry, prow, m, ring, counter, stats, tag, kv0, kv1, kv2, kv3,
                    meta, num_sources, src_tags, halves)


# C-contiguous (``::1``) where every caller passes contiguous arrays (the ops check it): indexing
# needs no strides, and a non-contiguous batch array is refused at the call (TypeError) before
# anything runs; tables (page table, truth, pool_out), KV sources and held slots take any layout
_CHECK_SIG = ("int64(int64[:, ::1], int64[::1], int64[::1], int64[::1], int32[:, :], int64[::1], int64[::1], "
              "int64[::1], int32[:, :], int64[::1], int64[::1], int64[::1], int64[::1], int64[::1], int64[:], "
              "int64[:, ::1], "
              "int64[:, ::1], int64[::1], int64[:, ::1], int32[:], int32[:], int32[:], int32[:], int64[:, ::1], "
              "int64[::1], int64, int64, int64, int64, int64)")
_VERIFY_SIG = ("void(int64[:, ::1], int32[::1], int32[::1], int32[::1], int32[::1], int32[::1], int32[::1], "
               "int64[::1], int32[::1], int64[:, ::1], int64[::1], int64[:, ::1], int32[:], int32[:], int32[:], "
               "int32[:], int64[:, ::1], int64[::1], int64, int64, int64)")
# inlined: the scalar functions of the hot loops; called: the rest (inlined, their array arguments
# became reference-count updates on every entry: 2x slower on a clean step)
INLINED = ("_mix", "_link", "_translate", "_in_lut", "_entry_check")
CALLED = ("_scatter_bad", "_scatter_rows", "_fingerprints", "_append", "_report_entry", "_verify_entries",
          "_verify_prefixes", "_unmark_readers", "_writes", "_stamp", "_marks_io", "_batch_ok")
KERNELS = {"check": ("_check", _CHECK_SIG), "verify": ("_verify", _VERIFY_SIG)}
