"""fingerprint: a 64-bit hash of the real K/V bytes of slots, from up to 4 KV sources.

A KV source is one buffer of the pool (say layer 0's K) seen as int32 words. Slot s starts at
byte ``(s // page_size) * page_stride + (s % page_size) * bytes_per_token``; token-major layouts
(``[num_slots, heads, dim]`` or ``[num_pages, page_size, heads, dim]``) have
``page_stride = page_size * bytes_per_token``. Rows are 16-byte aligned.

The fold reads ``words`` int32 words per row (mode PARTIAL: the first 16 bytes; ALL: the whole
row) and is a sum, so every word is independent and a row is read at memory speed::

    acc_i = sum_w uint32(word_w) * K_w   (mod 2**64),   K_w = (2w + 1) * GOLDEN   (odd)
    fp    = splitmix64(FP_SEED ^ sum_i splitmix64(acc_i + (i + 1) * GOLDEN))

The sources are mixed independently and summed (not chained), so every source of every slot
is folded in one vectorised pass. Recording a fingerprint also records the slot's side word
(``DeviceState.source_tags``): the low 16 bits of each source's mixed part,
``tags = sum_i (splitmix64(acc_i + (i + 1) * GOLDEN) & 0xFFFF) << 16i``. A verifier that finds a
fingerprint mismatch compares the parts with the side word and names the differing sources in
the row's tag column (``mismatch_tag``): ``tag' = (tag & ~1 | half of the first differing
source) | mask << 8``, bit i of ``mask`` set when source i's part differs.

A change inside one word changes acc by d * K_w with K_w odd, so any single-word change (every
bit flip) is always caught; multi-word changes collide with probability about 2**-64.
"""

from __future__ import annotations

import math

import torch

from kvcanary.core.hashing import GOLDEN, MASK64, to_signed
from kvcanary.core.record import (
    FINGERPRINT,
    MAX_SOURCES,
    SOURCE_MASK_SHIFT,
    SOURCE_TAG_BITS,
    FingerprintMode,
    record_words,
)
from kvcanary.errors import InputTypeError
from kvcanary.ops._common import (
    Backend,
    cdiv,
    check_contiguous,
    check_len,
    check_no_alias,
    check_same_device,
    check_tensor,
    tl,
    triton,
    use_triton,
)
from kvcanary.ops._jit import mix64, source_ptr
from kvcanary.ops.sources import (  # noqa: F401  (their home; imported from here too)
    PARTIAL_BYTES,
    KVSource,
    SourceSet,
    source_meta,
    validate_meta,
    validate_sources,
)
from kvcanary.ops.state import DeviceState, check_state

FP_SEED = 0x66696E6765727072  # "fingerpr"


def _word_keys(n: int, device) -> torch.Tensor:
    w = torch.arange(n, dtype=torch.int64, device=device)
    return (2 * w + 1) * to_signed(GOLDEN)


def fingerprint_torch(slots: torch.Tensor, sources, mode: FingerprintMode) -> tuple[torch.Tensor, torch.Tensor]:
    """(fingerprint, side word) of each slot (int64[n] each); slots must be valid (the caller masks)."""
    from kvcanary.core.hashing import splitmix64_torch

    s = slots.to(torch.int64)
    accs = []
    for src in sources:
        nw = src.words_read(mode)
        tw = src.bytes_per_token // 4
        if src.page_stride == src.page_size * src.bytes_per_token:  # token-major: slot s is row s
            words = src.words[: src.num_slots * tw].view(src.num_slots, tw)[:, :nw].index_select(0, s)
        else:
            base = (s // src.page_size) * (src.page_stride // 4) + (s % src.page_size) * tw
            words = src.words[base[:, None] + torch.arange(nw, device=s.device)[None, :]]
        accs.append(((words.to(torch.int64) & 0xFFFFFFFF) * _word_keys(nw, s.device)[None, :]).sum(dim=1))
    salts = torch.tensor([to_signed(((i + 1) * GOLDEN) & MASK64) for i in range(len(sources))], device=s.device)
    parts = splitmix64_torch(torch.stack(accs) + salts[:, None])
    shifts = torch.arange(len(sources), dtype=torch.int64, device=s.device)[:, None] * SOURCE_TAG_BITS
    tags = ((parts & 0xFFFF) << shifts).sum(dim=0)
    return splitmix64_torch(parts.sum(dim=0) ^ to_signed(FP_SEED)), tags


def source_halves(sources) -> int:
    """Bit i set when source i is a V half (the kernels' ``halves`` argument)."""
    return sum(int(src.half) << i for i, src in enumerate(sources))


def mismatch_tag_torch(tag: int, fp_bad: torch.Tensor, stored_tags: torch.Tensor, exp_tags: torch.Tensor,
                       sources) -> torch.Tensor:
    """The tag column per lane (int64[n]): ``tag`` where the fingerprint matches, else the launch
    tag with the half of the first differing source and the source mask above it (module doc)."""
    diff = (stored_tags ^ exp_tags)
    mask = torch.zeros_like(diff)
    half = torch.full_like(diff, int(sources[0].half) if sources else 0)
    for i in reversed(range(len(sources))):  # the lowest differing source wins
        bad = ((diff >> (SOURCE_TAG_BITS * i)) & 0xFFFF) != 0
        mask |= bad.to(torch.int64) << i
        half = torch.where(bad, torch.full_like(half, int(sources[i].half)), half)
    fp_tag = (tag & ~1) | half | (mask << SOURCE_MASK_SHIFT)
    return torch.where(fp_bad, fp_tag, torch.full_like(fp_tag, tag))


# --- triton --------------------------------------------------------------------------------

@triton.jit
def _source_acc(words_ptr, slot, ok, page_size, page_stride_w, token_w, n_words, BLOCK_S: tl.constexpr,
                BLOCK_W: tl.constexpr):
    """sum_w uint32(word_w) * (2w + 1) * GOLDEN over a row; GOLDEN is factored out of the sum (the
    same value mod 2**64) so each word costs one widening multiply by a small odd factor. BLOCK_W
    divides n_words (host-chosen), so only the row mask remains and loads stay 16 bytes wide."""
    base = tl.multiple_of((slot // page_size) * page_stride_w + (slot % page_size) * token_w, 4)
    acc = tl.zeros((BLOCK_S, BLOCK_W), dtype=tl.uint64)
    for w0 in range(0, n_words, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        x = tl.load(words_ptr + base[:, None] + w[None, :], mask=ok[:, None], other=0)
        acc += x.to(tl.uint32, bitcast=True).to(tl.uint64) * (2 * w + 1).to(tl.uint64)[None, :]
    return tl.sum(acc, axis=1) * 0x9E3779B97F4A7C15


@triton.jit
def fold_sources(slot, ok, w0_ptr, w1_ptr, w2_ptr, w3_ptr, meta_ptr, NUM_SOURCES: tl.constexpr,
                 BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr):
    """(fingerprint, side word), uint64[BLOCK_S] each, of ``slot`` lanes where ``ok``; ``meta_ptr``
    holds per source (page_size, page_stride_words, token_words, words_read) as int64[4, 4]."""
    total = tl.zeros((BLOCK_S,), dtype=tl.uint64)
    tags = tl.zeros((BLOCK_S,), dtype=tl.uint64)
    for i in tl.static_range(NUM_SOURCES):
        acc = _source_acc(source_ptr(w0_ptr, w1_ptr, w2_ptr, w3_ptr, i), slot, ok, tl.load(meta_ptr + 4 * i),
                          tl.load(meta_ptr + 4 * i + 1), tl.load(meta_ptr + 4 * i + 2), tl.load(meta_ptr + 4 * i + 3),
                          BLOCK_S, BLOCK_W)
        # (i + 1) * GOLDEN mod 2**64: from the second source on, the product no longer fits a uint64 constant
        part = mix64(acc + (((i + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF))
        total += part
        tags |= (part & 0xFFFF) << (16 * i)
    return mix64(total ^ 0x66696E6765727072), tags


@triton.jit
def mismatch_tag(tag, fp_bad, stored_tags, exp_tags, halves, NUM_SOURCES: tl.constexpr):
    """Triton twin of ``mismatch_tag_torch``: ``halves`` has bit i set when source i is V;
    ``stored_tags`` / ``exp_tags`` are uint64 lanes. Returns int64 lanes."""
    diff = stored_tags ^ exp_tags
    mask = tl.zeros_like(diff).to(tl.int64)
    half = tl.zeros_like(mask) + (halves & 1)
    found = tl.zeros_like(fp_bad)
    for i in tl.static_range(NUM_SOURCES):
        bad = ((diff >> (16 * i)) & 0xFFFF) != 0
        mask |= bad.to(tl.int64) << i
        half = tl.where(bad & (found == 0), (halves >> i) & 1, half)
        found = found | bad
    return tl.where(fp_bad, ((tag // 2) * 2) | half | (mask << 8), tl.zeros_like(mask) + tag)


def block_words(sources, mode: FingerprintMode, cap: int = 128) -> int:
    """The word-tile width: the largest power of two <= cap dividing every source's words_read."""
    g = 0
    for src in sources:
        g = math.gcd(g, src.words_read(mode))
    b = 4
    while b * 2 <= cap and g % (b * 2) == 0:
        b *= 2
    return b


def source_words(sources, fallback: torch.Tensor) -> list[torch.Tensor]:
    """The four word tensors a kernel takes; unused ones repeat a valid tensor (never read)."""
    ptrs = [src.words for src in sources] or [fallback]
    return ptrs + [ptrs[0]] * (MAX_SOURCES - len(ptrs))


@triton.jit
def _fingerprint_kernel(slots_ptr, out_ptr, words_ptr, tags_ptr, n, num_slots, w0_ptr, w1_ptr, w2_ptr, w3_ptr,
                        meta_ptr, RECORD: tl.constexpr, NUM_SOURCES: tl.constexpr, BLOCK_S: tl.constexpr,
                        BLOCK_W: tl.constexpr):
    """Program p fingerprints slots[p*BLOCK_S : (p+1)*BLOCK_S]; invalid slots (<= 0 or >= num_slots)
    yield 0 and are not recorded. With RECORD, word 3 of each valid slot's record gets the value
    and its side word the sources' parts."""
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BLOCK_S + tl.arange(0, BLOCK_S).to(tl.int64)
    live = i < n
    slot = tl.load(slots_ptr + i, mask=live, other=0)
    ok = live & (slot > 0) & (slot < num_slots)
    slot = tl.where(ok, slot, 0)
    h, tags = fold_sources(slot, ok, w0_ptr, w1_ptr, w2_ptr, w3_ptr, meta_ptr, NUM_SOURCES, BLOCK_S, BLOCK_W)
    fp = tl.where(ok, h.to(tl.int64, bitcast=True), 0)
    tl.store(out_ptr + i, fp, mask=live)
    if RECORD:
        tl.store(words_ptr + slot * 4 + 3, fp, mask=ok)
        tl.store(tags_ptr + slot, tags.to(tl.int64, bitcast=True), mask=ok)


def fingerprint(*, slots: torch.Tensor, sources, mode: FingerprintMode, state: DeviceState,
                out: torch.Tensor | None = None, record: bool = False, meta: torch.Tensor | None = None,
                backend: Backend = Backend.AUTO) -> torch.Tensor:
    """Fingerprint ``slots`` (int64[n]) into ``out`` (int64[n]); with ``record``, also store each
    valid slot's value in its record of ``state.records`` and its side word in
    ``state.source_tags``. Slots <= 0 or >= num_slots give 0 and are skipped. Mode NONE writes
    zeros. ``meta`` may pass a preallocated table from ``source_meta`` (CUDA graphs). Raises
    InputTypeError / InputError for wrong dtypes, shapes, devices, sources or meta, before
    anything is written.
    """
    check_state(state)
    check_tensor("slots", slots, torch.int64, 1)
    if not isinstance(mode, FingerprintMode):
        raise InputTypeError(f"mode must be a FingerprintMode, got {mode!r}")
    if type(record) is not bool:
        raise InputTypeError(f"record must be True or False, got {type(record).__name__} {record!r}")
    if out is None and isinstance(slots, torch.Tensor):
        out = torch.empty_like(slots)
    check_tensor("out", out, torch.int64, 1)
    check_len("out", out, slots.shape[0], "len(slots)")
    canary = state.records
    device = check_same_device(records=canary, slots=slots, out=out)
    kv = SourceSet.resolve(sources, mode, meta, canary.shape[0], device)
    sources, mode, meta = kv.list(), kv.mode, kv.meta
    for name, t in (("slots", slots), ("out", out)):
        check_contiguous(name, t)
    check_no_alias("out", out, {"slots": slots, "state.records": canary, "state.source_tags": state.source_tags,
                                **{f"sources[{i}].words": src.words for i, src in enumerate(sources)}})
    n, num_slots = slots.shape[0], canary.shape[0]
    ok = None
    tags = None
    if not sources:  # mode NONE: the recorded fingerprint (and side word) is 0
        out.zero_()
        tags = torch.zeros_like(out)
    elif use_triton(backend, device):
        block_w = block_words(sources, mode)
        block_s = 32 if block_w > 4 else 128
        _fingerprint_kernel[(max(cdiv(n, block_s), 1),)](
            slots, out, record_words(canary), state.source_tags, n, num_slots, *source_words(sources, slots), meta,
            RECORD=record,
            NUM_SOURCES=len(sources), BLOCK_S=block_s, BLOCK_W=block_w, num_warps=8 if block_w > 4 else 4)
        return out
    else:
        ok = (slots > 0) & (slots < num_slots)
        fp, tags = fingerprint_torch(torch.where(ok, slots, torch.zeros_like(slots)), sources, mode)
        out.copy_(torch.where(ok, fp, torch.zeros_like(fp)))
    if record:
        ok = (slots > 0) & (slots < num_slots) if ok is None else ok
        record_words(canary)[slots[ok], FINGERPRINT] = out[ok]
        state.source_tags[slots[ok]] = tags[ok]
    return out
