"""Triton device functions shared by the kernels: the hashes of core.hashing and the
segment lookup. Values are uint64 inside kernels and stored as int64 bit patterns."""

from __future__ import annotations

from kvcanary.ops._common import tl, triton


@triton.jit
def mix64(x):
    """splitmix64 finaliser on uint64."""
    x = x ^ (x >> 30)
    x = x * 0xBF58476D1CE4E5B9
    x = x ^ (x >> 27)
    x = x * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def link64(token, position):
    """core.hashing.link on int64 inputs; returns uint64."""
    h = mix64(token.to(tl.uint64, bitcast=True) ^ 0x6B762D63616E6172)
    return mix64(h ^ (position.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15))


@triton.jit
def find_segment(ends_ptr, idx, n, NBITS: tl.constexpr):
    """For each ``idx``, the count of ``ends_ptr[0:n]`` entries <= idx (branchless binary search).

    With ``ends_ptr = offsets + 1`` (the segment ends) this is the segment owning ``idx``;
    ``n`` (the number of segments) means "past the last segment". Reads stay inside [0, n).
    """
    pos = tl.zeros_like(idx)
    for k in tl.static_range(NBITS):
        step = 1 << (NBITS - 1 - k)
        probe = pos + step
        ok = probe <= n
        val = tl.load(ends_ptr + (probe - 1), mask=ok, other=0)
        pos = tl.where(ok & (val <= idx), probe, pos)
    return pos


@triton.jit
def seg_add(f1, v1, f2, v2):
    """Combine of a segmented sum: a set flag on the right restarts the sum."""
    return f1 | f2, tl.where(f2 != 0, v2, v1 + v2)


@triton.jit
def append_violations(ring_ptr, counter_ptr, capacity, bad, tag, slot, stored_pos, stored_tok, expected_tok,
                      stored_val, expected_val, reasons):
    """Append one 8-int64 row per lane where ``bad`` to the fill-once ring: one atomic add per
    program claims a run of rows; rows at index >= capacity are dropped but stay counted, and so
    are rows at a negative index (a counter that was negative or wrapped past 2**63)."""
    n_bad = tl.sum(bad.to(tl.int64), 0)
    base = tl.atomic_add(counter_ptr, n_bad, mask=n_bad > 0)
    idx = base + tl.cumsum(bad.to(tl.int64), 0) - 1
    ok = bad & (idx >= 0) & (idx < capacity)
    row = ring_ptr + idx * 8
    tl.store(row + 0, tl.zeros_like(idx) + tag, mask=ok)
    tl.store(row + 1, slot.to(tl.int64), mask=ok)
    tl.store(row + 2, stored_pos.to(tl.int64), mask=ok)
    tl.store(row + 3, stored_tok.to(tl.int64), mask=ok)
    tl.store(row + 4, expected_tok.to(tl.int64), mask=ok)
    tl.store(row + 5, stored_val.to(tl.int64, bitcast=True), mask=ok)
    tl.store(row + 6, expected_val.to(tl.int64, bitcast=True), mask=ok)
    tl.store(row + 7, reasons.to(tl.int64), mask=ok)


@triton.jit
def source_ptr(w0_ptr, w1_ptr, w2_ptr, w3_ptr, INDEX: tl.constexpr):
    """The words of KV source INDEX of the four a kernel takes (INDEX a compile-time index)."""
    ptr = w0_ptr
    if INDEX == 1:
        ptr = w1_ptr
    if INDEX == 2:
        ptr = w2_ptr
    if INDEX == 3:
        ptr = w3_ptr
    return ptr
