"""stamp: write (token, position, chain, 0) into the canary record of every slot a forward writes.

| argument          | dtype / shape        | meaning                                               |
|-------------------|----------------------|-------------------------------------------------------|
| state             | DeviceState          | records written in place; ring, stats                 |
| out_cache_loc     | int64[T]             | slot per written token (translated through lut)       |
| input_ids         | int64[T]             | token written                                         |
| positions         | int64[T]             | position written                                      |
| req_pool_indices  | int64[bs]            | row 0 = padding request: not stamped, not checked     |
| prefix_lens       | int64[bs]            | position of request r's first written token           |
| write_offsets     | int64[bs+1]          | from build_plan: request r writes [off[r], off[r+1])  |
| seed              | int64[bs]            | from build_plan: the last prefix slot, or -1          |
| expected_tokens   | int64[T] or None     | from gather_expected_tokens: enables WRITE_TOKEN      |

The chain is a segmented exclusive scan: for token j of request r,
``chain = base[r] + sum_{i<j} link(input_ids[off+i], positions[off+i])`` with
``base[r] = chain[seed] + link(token[seed], position[seed])``, or ANCHOR when there is no seed.
Checks: WRITE_POSITION when ``positions[t] != prefix_lens[r] + j`` or (j == 0) the seed's stored
position + 1 differs; WRITE_TOKEN when ``input_ids[t] != expected_tokens[t]``. Violations go to the
ring with the written position/token as the stored fields. Slots <= 0 or >= num_slots (after the
LUT) are not written; for a real request (row != 0) such a target is a BAD_ENTRY row: slot = the
``out_cache_loc`` value, stored value = the request's page-table row, expected value = the
translated slot (core.record). ``stats[tag, STAMPED]`` counts stamped slots.
"""

from __future__ import annotations

import torch

from kvcanary.core.hashing import ANCHOR_S, link_torch
from kvcanary.core.record import CHAIN, POSITION, STAT_STAMPED, TOKEN, Reason, record_words
from kvcanary.errors import InputError
from kvcanary.ops._common import (
    Backend,
    cdiv,
    check_contiguous,
    check_len,
    check_lut,
    check_same_device,
    check_tensor,
    num_bits,
    searchsorted_right,
    tl,
    triton,
    use_triton,
)
from kvcanary.ops._jit import append_violations, find_segment, link64, seg_add
from kvcanary.ops._ring import append_violations_torch, validate_ring
from kvcanary.ops.gather import validate_offsets
from kvcanary.ops.plan import _translate, _translate_torch
from kvcanary.ops.state import DeviceState

WRITE_TOKEN = int(Reason.WRITE_TOKEN)
WRITE_POSITION = int(Reason.WRITE_POSITION)
BAD_ENTRY = int(Reason.BAD_ENTRY)


def validate_stamp(state, out_cache_loc, input_ids, positions, req_pool_indices, prefix_lens, write_offsets,
                   seed, expected_tokens, lut, tag):
    tag = validate_ring(state, tag)
    canary = state.records
    for name, t in (("out_cache_loc", out_cache_loc), ("input_ids", input_ids), ("positions", positions),
                    ("req_pool_indices", req_pool_indices), ("prefix_lens", prefix_lens),
                    ("write_offsets", write_offsets), ("seed", seed)):
        check_tensor(name, t, torch.int64, 1)
    if expected_tokens is not None:
        check_tensor("expected_tokens", expected_tokens, torch.int64, 1)
    check_lut(lut)
    check_same_device(records=canary, out_cache_loc=out_cache_loc, input_ids=input_ids, positions=positions,
                      req_pool_indices=req_pool_indices, prefix_lens=prefix_lens, write_offsets=write_offsets,
                      seed=seed, expected_tokens=expected_tokens, lut=lut)
    n, bs = input_ids.shape[0], req_pool_indices.shape[0]
    check_len("out_cache_loc", out_cache_loc, n, "len(input_ids)")
    check_len("positions", positions, n, "len(input_ids)")
    if expected_tokens is not None:
        check_len("expected_tokens", expected_tokens, n, "len(input_ids)")
    check_len("prefix_lens", prefix_lens, bs, "bs")
    check_len("seed", seed, bs, "bs")
    validate_offsets("write_offsets", write_offsets, bs, n)
    return tag


def _stamp_torch(state, loc, ids, pos, rpi, prefix_lens, woff, seed, expected, lut, tag):
    canary, ring, counter, stats = state.records, state.ring, state.ring_counter, state.stats
    n, bs, num_slots = ids.shape[0], rpi.shape[0], canary.shape[0]
    if n == 0 or bs == 0:
        return
    words = record_words(canary)
    t = torch.arange(n, device=ids.device)
    r = searchsorted_right(woff[1:], t)
    has = r < bs
    rc = r.clamp(max=bs - 1)
    start = woff[rc]
    j = t - start
    lk = torch.where(has, link_torch(ids, pos), torch.zeros_like(ids))
    incl = torch.cumsum(lk, 0)  # int64 wraps: a global scan; subtract the sum before each segment start
    excl = incl - lk - torch.where(start > 0, incl[(start - 1).clamp(min=0)], torch.zeros_like(incl))
    s = seed[rc]
    seed_ok = has & (s > 0) & (s < num_slots)
    srec = words[torch.where(seed_ok, s, torch.zeros_like(s))]
    base = torch.where(seed_ok, srec[:, CHAIN] + link_torch(srec[:, TOKEN], srec[:, POSITION]),
                       torch.full_like(s, ANCHOR_S))
    chain = base + excl
    slot = _translate_torch(loc, lut) if lut is not None else loc
    real = has & (rpi[rc] != 0)
    ok = real & (slot > 0) & (slot < num_slots)
    exp_pos = prefix_lens[rc] + j
    seed_pos_bad = seed_ok & (j == 0) & (srec[:, POSITION] + 1 != pos)
    pos_bad = real & ((pos != exp_pos) | seed_pos_bad)
    exp_pos = torch.where(pos != exp_pos, exp_pos, srec[:, POSITION] + 1)
    exp_tok = expected if expected is not None else ids
    tok_bad = real & (ids != exp_tok)
    bad = real & ~ok
    reasons = (pos_bad.to(torch.int64) * WRITE_POSITION + tok_bad.to(torch.int64) * WRITE_TOKEN
               + bad.to(torch.int64) * BAD_ENTRY)
    stored = torch.where(bad, rpi[rc], torch.where(pos_bad, pos, ids))
    want = torch.where(bad, slot, torch.where(pos_bad, exp_pos, exp_tok))
    # read every seed before writing: a seed inside this forward's writes is a bug the kernel races on
    words[slot[ok]] = torch.stack([ids, pos, chain, torch.zeros_like(ids)], dim=1)[ok]
    append_violations_torch(ring, counter, reasons != 0, tag,
                            [torch.where(bad, loc, slot), pos, ids, exp_tok, stored, want, reasons])
    stats[tag, STAT_STAMPED] += ok.sum()


@triton.jit
def _stamp_tails_kernel(ids_ptr, pos_ptr, woff_ptr, tails_ptr, n, bs, NBITS: tl.constexpr, BLOCK: tl.constexpr):
    """Phase 1 (only when T > BLOCK): tails[p] = sum of the links of block p from its last
    segment start (or from the block start when no segment starts inside it) to its end."""
    pid = tl.program_id(0).to(tl.int64)
    block_start = pid * BLOCK
    t = block_start + tl.arange(0, BLOCK).to(tl.int64)
    live = t < n
    r = find_segment(woff_ptr + 1, t, bs, NBITS)
    has = live & (r < bs)
    start = tl.load(woff_ptr + r, mask=has, other=0)
    lk = tl.where(has, link64(tl.load(ids_ptr + t, mask=live, other=0), tl.load(pos_ptr + t, mask=live, other=0)), 0)
    last_start = tl.max(tl.where(has & (t == start), t, block_start), 0)
    tl.store(tails_ptr + pid, tl.sum(tl.where(t >= last_start, lk, 0), 0).to(tl.int64, bitcast=True))


@triton.jit
def stamp_lanes(words_ptr, seed_ptr, prefix_ptr, r, has, t, start, ids, pos, excl, loc, slot, row, exp_tok,
                num_slots, ring_ptr, counter_ptr, ring_cap, stats_ptr, tag):
    """Stamp the lanes of one block once their exclusive link sums ``excl`` are known: continue
    from the seed record, check positions and tokens, write the records of valid slots, report,
    count. ``loc`` is the target as given, ``slot`` translated; ``row`` is request r's page-table row."""
    s = tl.load(seed_ptr + r, mask=has, other=-1)
    seed_ok = has & (s > 0) & (s < num_slots)
    s = tl.where(seed_ok, s, 0)
    s_tok = tl.load(words_ptr + s * 4 + 0, mask=seed_ok, other=0)
    s_pos = tl.load(words_ptr + s * 4 + 1, mask=seed_ok, other=0)
    s_chain = tl.load(words_ptr + s * 4 + 2, mask=seed_ok, other=0).to(tl.uint64, bitcast=True)
    base = tl.where(seed_ok, s_chain + link64(s_tok, s_pos), 0x4B5643414E415259)
    chain = base + excl
    real = has & (row != 0)
    ok = real & (slot > 0) & (slot < num_slots)
    exp_pos = tl.load(prefix_ptr + r, mask=has, other=0) + (t - start)
    pos_bad = real & ((pos != exp_pos) | (seed_ok & (t == start) & (s_pos + 1 != pos)))
    exp_pos = tl.where(pos != exp_pos, exp_pos, s_pos + 1)
    tok_bad = real & (ids != exp_tok)
    bad = real & ~ok
    reasons = pos_bad.to(tl.int64) * 16 + tok_bad.to(tl.int64) * 8 + bad.to(tl.int64) * 64
    dst = words_ptr + tl.where(ok, slot, 0) * 4
    tl.store(dst + 0, ids, mask=ok)
    tl.store(dst + 1, pos, mask=ok)
    tl.store(dst + 2, chain.to(tl.int64, bitcast=True), mask=ok)
    tl.store(dst + 3, tl.zeros_like(ids), mask=ok)
    append_violations(ring_ptr, counter_ptr, ring_cap, reasons != 0, tag, tl.where(bad, loc, slot), pos, ids, exp_tok,
                      tl.where(bad, row, tl.where(pos_bad, pos, ids)), tl.where(bad, slot, tl.where(pos_bad, exp_pos,
                                                                                                 exp_tok)), reasons)
    n_ok = tl.sum(ok.to(tl.int64), 0)
    tl.atomic_add(stats_ptr + tag * 3 + 2, n_ok, mask=n_ok > 0)


@triton.jit
def block_links(woff_ptr, ids_ptr, pos_ptr, t, live, bs, NBITS: tl.constexpr):
    """Written tokens ``t`` of one block (``live``: inside the batch): each one's request ``r`` (bs
    past the last), whether it belongs to one (``has``), its request's first token ``start``, its
    id, its position and its link (0 where it belongs to none)."""
    r = find_segment(woff_ptr + 1, t, bs, NBITS)
    has = live & (r < bs)
    start = tl.load(woff_ptr + r, mask=has, other=0)
    ids = tl.load(ids_ptr + t, mask=live, other=0)
    pos = tl.load(pos_ptr + t, mask=live, other=0)
    return r, has, start, ids, pos, tl.where(has, link64(ids, pos), 0)


@triton.jit
def block_targets(loc_ptr, lut_ptr, rpi_ptr, t, live, r, has, lut_len, HAS_LUT: tl.constexpr):
    """The write targets of tokens ``t``: each one's ``out_cache_loc``, its slot in this pool
    (through the window table with ``HAS_LUT``) and its request's page-table row (0 for none)."""
    loc = tl.load(loc_ptr + t, mask=live, other=0)
    slot = loc
    if HAS_LUT:
        slot = _translate(loc, lut_ptr, lut_len, True)
    return loc, slot, tl.load(rpi_ptr + r, mask=has, other=0)


@triton.jit
def _stamp_kernel(words_ptr, loc_ptr, ids_ptr, pos_ptr, rpi_ptr, prefix_ptr, woff_ptr, seed_ptr, exp_ptr, lut_ptr,
                  tails_ptr, ring_ptr, counter_ptr, stats_ptr, n, bs, num_slots, lut_len, ring_cap, tag,
                  HAS_EXPECTED: tl.constexpr, HAS_LUT: tl.constexpr, HAS_CARRY: tl.constexpr, NBITS: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Phase 2: program p stamps tokens [p*BLOCK, (p+1)*BLOCK). The chain is a segmented scan
    inside the block (flag = segment start or lane 0) plus, for the segment already open at the
    block start (it began at s0 in block b0), a carry = tails[b0] + ... + tails[p-1]: block b0's
    tail starts exactly at s0 and the blocks between hold no segment start."""
    pid = tl.program_id(0).to(tl.int64)
    block_start = pid * BLOCK
    lane = tl.arange(0, BLOCK).to(tl.int64)
    t = block_start + lane
    live = t < n
    r, has, start, ids, pos, lk = block_links(woff_ptr, ids_ptr, pos_ptr, t, live, bs, NBITS)
    flag = ((t == start) | (lane == 0)).to(tl.int32)
    _, incl = tl.associative_scan((flag, lk), 0, seg_add)
    excl = incl - lk
    # carry for the segment open at block_start (r at lane 0 is the smallest r in the block)
    r0 = tl.min(r, 0)
    s0 = tl.load(woff_ptr + tl.minimum(r0, bs), mask=r0 < bs, other=block_start)
    s0 = tl.maximum(s0, 0)  # unchecked device offsets may be negative: never re-read before input_ids
    carry = tl.zeros((), dtype=tl.uint64)
    if HAS_CARRY:
        for b in range(s0 // BLOCK, pid, BLOCK):
            bb = b + lane
            carry += tl.sum(tl.load(tails_ptr + bb, mask=bb < pid, other=0).to(tl.uint64, bitcast=True), 0)
    excl += tl.where((r == r0) & (s0 < block_start), carry, 0)
    loc, slot, row = block_targets(loc_ptr, lut_ptr, rpi_ptr, t, live, r, has, lut_len, HAS_LUT)
    exp_tok = ids
    if HAS_EXPECTED:
        exp_tok = tl.load(exp_ptr + t, mask=live, other=0)
    stamp_lanes(words_ptr, seed_ptr, prefix_ptr, r, has, t, start, ids, pos, excl, loc, slot, row, exp_tok, num_slots,
                ring_ptr, counter_ptr, ring_cap, stats_ptr, tag)


MIN_BLOCK = 128  # the smallest block of tokens a program stamps; ``scratch`` holds one sum per block


def _stamp_block(n: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for ``n`` written tokens: the smallest power of two in [128, 1024] whose
    square is at least n / 2, so a program's carry over the earlier blocks' tails takes at most two
    vector loads, while a long prefill spreads over many short programs (H200, one request of
    32768 tokens: 16.2 µs with BLOCK 1024, 9.2 µs with BLOCK 128; BENCHMARKS.md)."""
    block = MIN_BLOCK
    while block < 1024 and 2 * block * block < n:
        block *= 2
    return block, 4 if block == MIN_BLOCK else 8


def stamp(*, state: DeviceState, out_cache_loc: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
          req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, write_offsets: torch.Tensor, seed: torch.Tensor,
          tag: int, expected_tokens: torch.Tensor | None = None, lut: torch.Tensor | None = None,
          scratch: torch.Tensor | None = None, backend: Backend = Backend.AUTO) -> None:
    """Stamp the written slots into ``state.records`` (see module doc). Never raises on values;
    raises InputTypeError / InputError for wrong dtypes, shapes, devices, offsets, state or tag,
    before anything is written. ``scratch`` (int64[>= cdiv(T, 128)]) holds the Triton path's
    per-block sums; it is allocated when None (pass one inside CUDA-graph capture)."""
    tag = validate_stamp(state, out_cache_loc, input_ids, positions, req_pool_indices, prefix_lens,
                         write_offsets, seed, expected_tokens, lut, tag)
    device = state.device
    for name, t in (("out_cache_loc", out_cache_loc), ("input_ids", input_ids), ("positions", positions),
                    ("req_pool_indices", req_pool_indices), ("prefix_lens", prefix_lens),
                    ("write_offsets", write_offsets), ("seed", seed), ("expected_tokens", expected_tokens),
                    ("lut", lut)):
        if t is not None:
            check_contiguous(name, t)
    n, bs = input_ids.shape[0], req_pool_indices.shape[0]
    block, warps = _stamp_block(n)
    nblocks = max(cdiv(n, block), 1)
    if scratch is not None:
        check_tensor("scratch", scratch, torch.int64, 1)
        check_contiguous("scratch", scratch)
        need = max(cdiv(n, MIN_BLOCK), 1)
        if scratch.shape[0] < need:
            raise InputError(f"scratch length {scratch.shape[0]} < cdiv(T, {MIN_BLOCK}) ({need})")
        check_same_device(records=state.records, scratch=scratch)
    if use_triton(backend, device):
        if scratch is None:
            scratch = torch.empty(nblocks, dtype=torch.int64, device=device)
        if nblocks > 1:
            _stamp_tails_kernel[(nblocks,)](input_ids, positions, write_offsets, scratch, n, bs,
                                            NBITS=num_bits(bs), BLOCK=block, num_warps=warps)
        _stamp_kernel[(nblocks,)](
            record_words(state.records), out_cache_loc, input_ids, positions, req_pool_indices, prefix_lens,
            write_offsets, seed, expected_tokens if expected_tokens is not None else input_ids,
            lut if lut is not None else seed, scratch, state.ring, state.ring_counter, state.stats, n, bs,
            state.num_slots, lut.shape[0] if lut is not None else 0, state.ring_capacity, tag,
            HAS_EXPECTED=expected_tokens is not None, HAS_LUT=lut is not None, HAS_CARRY=nblocks > 1,
            NBITS=num_bits(bs), BLOCK=block, num_warps=warps)
    else:
        _stamp_torch(state, out_cache_loc, input_ids, positions, req_pool_indices, prefix_lens, write_offsets,
                     seed, expected_tokens, lut, tag)
