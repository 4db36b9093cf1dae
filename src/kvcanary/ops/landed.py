"""mark_writes / check_writes_landed: did the forward write every slot it was asked to?

HEAD marks, TAIL checks. For every written token t whose slot s (``out_cache_loc[t]``, through
``lut``) is valid (0 < s < num_slots; padding and bad targets are skipped), and for every KV
source i (the layers and halves the real-KV mode covers):

| op                  | what happens to the first 16 bytes of slot s's row in source i        |
|---------------------|-------------------------------------------------------------------------|
| mark_writes         | overwritten with the slot's mark (below); the old bytes are dead: the   |
|                     | forward overwrites them (a target the batch reads is a READ_CONFLICT)   |
| check_writes_landed | compared with the mark: equal = the forward did not write that source   |

The mark depends on the slot only (so duplicate targets mark the same bytes, without a race)::

    m_k = splitmix64((s ^ MARK_SEED) + k * GOLDEN),  k = 0, 1   ->  int32 words lo(m0) hi(m0) lo(m1) hi(m1)

A real K/V write produces it with probability about 2**-128.

A token whose slot still holds the mark in any source is one MISSED_WRITE row: slot s, the written
position and token, expected token -1, stored value = bitmask of the sources still marked (bit i =
``sources[i]``), expected value 0; the tag's half is the half of the first marked source. Its
``landed[t]`` is False (True for every other token), so the caller records no fingerprint for it:
the record keeps what HEAD's stamp wrote (fingerprint 0), and every later fingerprint check of the
slot fails until it is rewritten.

| argument       | dtype / shape   | meaning                                                       |
|----------------|-----------------|---------------------------------------------------------------|
| state          | DeviceState     | pool size; ring and counter (check_writes_landed)             |
| out_cache_loc  | int64[T]        | slot per written token                                        |
| input_ids      | int64[T]        | token written (check_writes_landed: the row's token)          |
| positions      | int64[T]        | position written (check_writes_landed: the row's position)    |
| sources        | list[KVSource]  | covered buffers (at most 4); empty: nothing marked or checked |
| lut            | int64[n] / None | window pool: slot translation                                 |
| out            | bool[T] / None  | check_writes_landed: ``landed``, allocated when None          |
"""

from __future__ import annotations

import torch

from kvcanary.core.hashing import GOLDEN, splitmix64_torch, to_signed
from kvcanary.core.record import Reason
from kvcanary.errors import InputTypeError
from kvcanary.ops._common import (
    Backend,
    cdiv,
    check_contiguous,
    check_len,
    check_lut,
    check_no_alias,
    check_same_device,
    check_tensor,
    tl,
    triton,
    use_triton,
)
from kvcanary.ops._jit import append_violations, mix64, source_ptr
from kvcanary.ops._ring import append_violations_torch, validate_ring
from kvcanary.ops.fingerprint import FingerprintMode, source_meta, source_words, validate_meta, validate_sources
from kvcanary.ops.launcher import launch
from kvcanary.ops.plan import _translate, _translate_torch
from kvcanary.ops.state import DeviceState, check_state

MARK_SEED = 0x6D697373696E6721  # "missing!"
MARK_WORDS = 4  # int32 words: the first 16 bytes of a row
MISSED_WRITE = int(Reason.MISSED_WRITE)
BLOCK = 256


def validate_landed(state, out_cache_loc, sources, lut, others: dict) -> torch.device:
    check_state(state)
    check_tensor("out_cache_loc", out_cache_loc, torch.int64, 1)
    n = out_cache_loc.shape[0]
    for name, t in others.items():
        check_tensor(name, t, torch.int64, 1)
        check_len(name, t, n, "len(out_cache_loc)")
    check_lut(lut)
    if not isinstance(sources, list | tuple):
        raise InputTypeError(f"sources must be a list of KVSource, got {type(sources).__name__}")
    device = check_same_device(records=state.records, out_cache_loc=out_cache_loc, lut=lut, **others)
    validate_sources(sources, state.num_slots, device)
    return device


# --- torch ---------------------------------------------------------------------------------

def mark_torch(slots: torch.Tensor) -> torch.Tensor:
    """int32[n, 4]: the mark of each slot."""
    base = slots.to(torch.int64) ^ to_signed(MARK_SEED)
    m = torch.stack([splitmix64_torch(base), splitmix64_torch(base + to_signed(GOLDEN))], dim=1)
    return m.contiguous().view(torch.int32)


def _row_words(src, slots: torch.Tensor) -> torch.Tensor:
    """int64[n, 4]: indices into ``src.words`` of the first 16 bytes of each slot's row."""
    base = (slots // src.page_size) * (src.page_stride // 4) + (slots % src.page_size) * (src.bytes_per_token // 4)
    return base[:, None] + torch.arange(MARK_WORDS, device=slots.device)[None, :]


def _valid(state, loc, lut):
    slot = _translate_torch(loc, lut)
    ok = (slot > 0) & (slot < state.num_slots)
    return torch.where(ok, slot, torch.zeros_like(slot)), ok


def _mark_writes_torch(state, loc, sources, lut):
    slot, ok = _valid(state, loc, lut)
    s = slot[ok]
    pattern = mark_torch(s)
    for src in sources:
        src.words[_row_words(src, s)] = pattern


def _landed_torch(state, loc, ids, pos, sources, lut, tag, out):
    slot, ok = _valid(state, loc, lut)
    pattern = mark_torch(slot)
    bits = torch.zeros_like(slot)
    first_half = torch.full_like(slot, -1)
    for i, src in enumerate(reversed(sources)):
        k = len(sources) - 1 - i
        hit = ok & (src.words[_row_words(src, slot)] == pattern).all(dim=1)
        bits |= hit.to(torch.int64) << k
        first_half = torch.where(hit, torch.full_like(slot, int(src.half)), first_half)
    missed = bits != 0
    out.copy_(~missed)
    for half in (0, 1):  # one append per half keeps the lane order inside each
        sel = missed & (first_half == half)
        append_violations_torch(state.ring, state.ring_counter, sel, (tag & ~1) | half,
                                [slot, pos, ids, torch.full_like(ids, -1), bits, torch.zeros_like(bits),
                                 torch.full_like(bits, MISSED_WRITE)])


# --- triton --------------------------------------------------------------------------------

@triton.jit
def mark_words(slot):
    """The mark of each slot lane as an int32[BLOCK, 4] tile (see module doc)."""
    base = slot.to(tl.uint64, bitcast=True) ^ 0x6D697373696E6721
    m0 = mix64(base)
    m1 = mix64(base + 0x9E3779B97F4A7C15)
    col = tl.arange(0, 4)[None, :]
    m = tl.where(col < 2, m0[:, None], m1[:, None])
    half = tl.where((col % 2) == 0, m & 0xFFFFFFFF, m >> 32)
    return half.to(tl.uint32).to(tl.int32, bitcast=True)


@triton.jit
def _row_base(slot, meta_ptr, i):
    page = tl.load(meta_ptr + 4 * i)
    return (slot // page) * tl.load(meta_ptr + 4 * i + 1) + (slot % page) * tl.load(meta_ptr + 4 * i + 2)


@triton.jit
def mark_lanes(slot, ok, w0_ptr, w1_ptr, w2_ptr, w3_ptr, meta_ptr, NUM_SOURCES: tl.constexpr):
    """mark_writes on a block of translated slots (lanes where ``ok``)."""
    s = tl.where(ok, slot, 0)
    pattern = mark_words(s)
    col = tl.arange(0, 4)[None, :]
    for i in tl.static_range(NUM_SOURCES):
        ptr = source_ptr(w0_ptr, w1_ptr, w2_ptr, w3_ptr, i)
        tl.store(ptr + _row_base(s, meta_ptr, i)[:, None] + col, pattern, mask=ok[:, None])


@triton.jit
def landed_lanes(slot, ok, pos, ids, w0_ptr, w1_ptr, w2_ptr, w3_ptr, meta_ptr, ring_ptr, counter_ptr, ring_cap, tag,
                 NUM_SOURCES: tl.constexpr, HALVES: tl.constexpr):
    """check_writes_landed on a block of translated slots; returns ``landed`` per lane.
    ``HALVES``: bit i = the half of source i (``source_halves``)."""
    s = tl.where(ok, slot, 0)
    pattern = mark_words(s)
    col = tl.arange(0, 4)[None, :]
    bits = tl.zeros_like(s)
    first_half = tl.zeros_like(s) - 1
    for k in tl.static_range(NUM_SOURCES):
        i = NUM_SOURCES - 1 - k  # last to first, so the first marked source's half stays
        ptr = source_ptr(w0_ptr, w1_ptr, w2_ptr, w3_ptr, i)
        got = tl.load(ptr + _row_base(s, meta_ptr, i)[:, None] + col, mask=ok[:, None], other=0)
        hit = ok & (tl.sum((got == pattern).to(tl.int32), axis=1) == 4)
        bits = bits | (hit.to(tl.int64) << i)
        first_half = tl.where(hit, (HALVES >> i) & 1, first_half)
    missed = bits != 0
    for h in tl.static_range(2):
        append_violations(ring_ptr, counter_ptr, ring_cap, missed & (first_half == h), (tag - tag % 2) + h, s, pos,
                          ids, tl.zeros_like(ids) - 1, bits, tl.zeros_like(bits), tl.zeros_like(bits) + 512)
    return ~missed


# the token count varies with every batch (1 at a decode of one request): specialising on it would
# compile a variant the warm-up never made at the first such step
@triton.jit(do_not_specialize=["n", "num_slots", "lut_len"])
def _mark_kernel(loc_ptr, lut_ptr, w0_ptr, w1_ptr, w2_ptr, w3_ptr, meta_ptr, n, num_slots, lut_len,
                 HAS_LUT: tl.constexpr, NUM_SOURCES: tl.constexpr, BLOCK: tl.constexpr):
    """Program p marks the slots of written tokens [p*BLOCK, (p+1)*BLOCK)."""
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    live = t < n
    slot = _translate(tl.load(loc_ptr + t, mask=live, other=0), lut_ptr, lut_len, HAS_LUT)
    mark_lanes(slot, live & (slot > 0) & (slot < num_slots), w0_ptr, w1_ptr, w2_ptr, w3_ptr, meta_ptr, NUM_SOURCES)


@triton.jit(do_not_specialize=["n", "num_slots", "lut_len", "ring_cap", "tag"])
def _landed_kernel(loc_ptr, ids_ptr, pos_ptr, lut_ptr, out_ptr, w0_ptr, w1_ptr, w2_ptr, w3_ptr, meta_ptr, ring_ptr,
                   counter_ptr, n, num_slots, lut_len, ring_cap, tag, HAS_LUT: tl.constexpr, NUM_SOURCES: tl.constexpr,
                   HALVES: tl.constexpr, BLOCK: tl.constexpr):
    """Program p checks the slots of written tokens [p*BLOCK, (p+1)*BLOCK)."""
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    live = t < n
    slot = _translate(tl.load(loc_ptr + t, mask=live, other=0), lut_ptr, lut_len, HAS_LUT)
    ok = live & (slot > 0) & (slot < num_slots)
    landed = landed_lanes(slot, ok, tl.load(pos_ptr + t, mask=live, other=0), tl.load(ids_ptr + t, mask=live, other=0),
                          w0_ptr, w1_ptr, w2_ptr, w3_ptr, meta_ptr, ring_ptr, counter_ptr, ring_cap, tag, NUM_SOURCES,
                          HALVES)
    tl.store(out_ptr + t, landed.to(tl.int8), mask=live)


def source_halves(sources) -> int:
    """The halves of the sources as one int, bit i = ``sources[i].half`` (``landed_lanes``' HALVES)."""
    return sum(int(s.half) << i for i, s in enumerate(sources))


def _launch_args(sources, lut, fallback, device, meta=None):
    if meta is None:  # page geometry only: words_read is unused
        meta = source_meta(sources, FingerprintMode.PARTIAL, device)
    return (lut if lut is not None else fallback, lut.shape[0] if lut is not None else 0,
            source_words(sources, fallback), meta)


def mark_writes(*, state: DeviceState, out_cache_loc: torch.Tensor, sources, lut: torch.Tensor | None = None,
                meta: torch.Tensor | None = None, mode: FingerprintMode = FingerprintMode.PARTIAL,
                backend: Backend = Backend.AUTO) -> None:
    """HEAD: overwrite the first 16 bytes of each valid write target's row in every source with
    the slot's mark (module doc). ``meta``: the sources' table (``source_meta`` of ``mode``; only its
    page geometry is read), built once: capturable, where None builds one per call. Raises
    InputTypeError / InputError for wrong dtypes, shapes, devices, sources or meta, before anything
    is written."""
    device = validate_landed(state, out_cache_loc, sources, lut, {})
    if not isinstance(mode, FingerprintMode):
        raise InputTypeError(f"mode must be a FingerprintMode, got {type(mode).__name__} {mode!r}")
    meta = validate_meta(meta, list(sources), mode, device)
    for name, t in (("out_cache_loc", out_cache_loc), ("lut", lut)):
        if t is not None:
            check_contiguous(name, t)
    sources = list(sources)
    if not sources:
        return
    if not use_triton(backend, device):
        _mark_writes_torch(state, out_cache_loc, sources, lut)
        return
    n = out_cache_loc.shape[0]
    lut_t, lut_len, words, meta = _launch_args(sources, lut, out_cache_loc, device, meta)
    launch(_mark_kernel, (max(cdiv(n, BLOCK), 1),), (out_cache_loc, lut_t, *words, meta, n, state.num_slots, lut_len),
           dict(HAS_LUT=lut is not None, NUM_SOURCES=len(sources), BLOCK=BLOCK))


def check_writes_landed(*, state: DeviceState, out_cache_loc: torch.Tensor, input_ids: torch.Tensor,
                        positions: torch.Tensor, sources, tag: int, lut: torch.Tensor | None = None,
                        out: torch.Tensor | None = None, backend: Backend = Backend.AUTO) -> torch.Tensor:
    """TAIL: report every written token whose slot still holds its mark in some source as a
    MISSED_WRITE row (module doc); returns ``landed`` (bool[T], in ``out`` when given). Never
    raises on values; raises InputTypeError / InputError for wrong dtypes, shapes, devices,
    sources, tag or state, before anything is written."""
    device = validate_landed(state, out_cache_loc, sources, lut, {"input_ids": input_ids, "positions": positions})
    tag = validate_ring(state, tag)
    n = out_cache_loc.shape[0]
    if out is None:
        out = torch.empty(n, dtype=torch.bool, device=device)
    check_tensor("out", out, torch.bool, 1)
    check_len("out", out, n, "len(out_cache_loc)")
    check_same_device(records=state.records, out=out)
    check_no_alias("out", out, {"out_cache_loc": out_cache_loc, "input_ids": input_ids, "positions": positions,
                                "lut": lut, "state.records": state.records, "state.ring": state.ring,
                                "state.ring_counter": state.ring_counter,
                                **{f"sources[{i}].words": src.words for i, src in enumerate(sources)}})
    for name, t in (("out_cache_loc", out_cache_loc), ("input_ids", input_ids), ("positions", positions),
                    ("lut", lut), ("out", out)):
        if t is not None:
            check_contiguous(name, t)
    sources = list(sources)
    if not sources:
        out.fill_(True)
        return out
    if not use_triton(backend, device):
        _landed_torch(state, out_cache_loc, input_ids, positions, sources, lut, tag, out)
        return out
    lut_t, lut_len, words, meta = _launch_args(sources, lut, out_cache_loc, device)
    _landed_kernel[(max(cdiv(n, BLOCK), 1),)](
        out_cache_loc, input_ids, positions, lut_t, out.view(torch.int8), *words, meta, state.ring, state.ring_counter,
        n, state.num_slots, lut_len, state.ring_capacity, tag, HAS_LUT=lut is not None, NUM_SOURCES=len(sources),
        HALVES=source_halves(sources), BLOCK=BLOCK)
    return out
