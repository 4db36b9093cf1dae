"""check_writes: write conflicts of one forward, found at HEAD before the model runs.

| argument          | dtype / shape        | meaning                                               |
|-------------------|----------------------|-------------------------------------------------------|
| plan              | Plan                 | this forward's verify plan (build_plan): the reads    |
| out_cache_loc     | int64[T]             | slot per written token (translated through lut)       |
| input_ids         | int64[T]             | token written                                         |
| positions         | int64[T]             | position written                                      |
| req_pool_indices  | int64[bs]            | page-table row per request (0 = padding)              |
| write_offsets     | int64[bs+1]          | from build_plan: request r writes [off[r], off[r+1])  |
| state             | DeviceState          | ring, counter (rows appended), pool size              |
| marks             | WriteMarks or None   | scratch of the Triton path (allocated when None)      |
| held              | int64[h] or None     | slots the prefix cache holds that no request reads    |

``check_forward`` also takes the held slots counted (``held_words``, int64[1 + capacity]: the
count, then the slots; a fixed buffer a captured HEAD reads at every replay): HEAD checks the
first ``count`` slots (the count clamped to [0, capacity]) as ``held`` and sets the count to 0.

Written token t (request r with ``off[r] <= t < off[r+1]``, padding lanes included) with a
translated slot s in (0, num_slots) is checked:

| reason         | fails when                                                              |
|----------------|-------------------------------------------------------------------------|
| WRITE_CONFLICT | a token t' < t of the forward also writes s (t' = the first such token) |
| READ_CONFLICT  | an entry of the verify plan reads s (the smallest reading row), or s is |
|                | in ``held`` (slots the prefix cache holds that no request reads: row 0) |

One row per failing token: slot s, the written position and token, expected token -1, stored
value = row[r], expected value = the first writer's row (WRITE_CONFLICT) or the reading row
(READ_CONFLICT only). Reads count when the plan is enabled: entries e < min(count, cap).

Triton path: ``marks.words[0, s]`` = min over writers of ``key | t``, ``marks.words[1, s]`` = min
over readers of ``key | row``, with ``key = (2**31 - 2 - epoch) << 32``, so the marks of earlier
launches are larger and need no clearing per launch; the launch itself advances ``marks.epoch``
(``advance_epoch``). The key fits int64 for epochs in [0, EPOCH_LIMIT): where the next epoch would
reach EPOCH_LIMIT (once every 2**32 - 1 launches, about 50 days at 1,000 a second), the same
launch sets every mark word back to UNMARKED and the epoch to 0, so a replayed CUDA graph restarts
too. The torch path computes the same minima directly and leaves ``marks`` alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcanary.core.record import Reason
from kvcanary.errors import InputError, InputTypeError
from kvcanary.ops._common import (
    Backend,
    cdiv,
    changed_buffers,
    check_contiguous,
    check_len,
    check_lut,
    check_same_device,
    check_tensor,
    layout_key,
    num_bits,
    searchsorted_right,
    tl,
    triton,
    use_triton,
)
from kvcanary.ops._jit import append_violations, find_segment
from kvcanary.ops._ring import append_violations_torch, validate_ring
from kvcanary.ops.gather import validate_offsets
from kvcanary.ops.plan import Plan, _translate, _translate_torch, validate_plan_buffers
from kvcanary.ops.state import DeviceState

WRITE_CONFLICT, READ_CONFLICT = int(Reason.WRITE_CONFLICT), int(Reason.READ_CONFLICT)
UNMARKED = 2**63 - 1
EPOCH_LIMIT = 2**32 - 1  # the first epoch whose key (epoch_key) leaves int64: the marks restart before it


@dataclass(frozen=True)
class WriteMarks:
    """Per-slot minima of the Triton conflict check (writer token, reading row) and its epoch.
    Allocate once per pool, outside any CUDA-graph capture."""

    words: torch.Tensor  # int64[2, num_slots]
    epoch: torch.Tensor  # int64[1]

    def __post_init__(self):
        check_tensor("WriteMarks.words", self.words, torch.int64, 2)
        check_tensor("WriteMarks.epoch", self.epoch, torch.int64, 1)
        if self.words.shape[0] != 2 or self.words.shape[1] < 2 or not self.words.is_contiguous():
            raise InputError(f"WriteMarks.words must be a contiguous int64[2, num_slots >= 2], got shape "
                             f"{tuple(self.words.shape)} strides {self.words.stride()}; use WriteMarks.allocate")
        if self.epoch.shape[0] != 1 or self.epoch.device != self.words.device:
            raise InputError(f"WriteMarks.epoch must be int64[1] on {self.words.device}, got shape "
                             f"{tuple(self.epoch.shape)} on {self.epoch.device}; use WriteMarks.allocate")
        object.__setattr__(self, "_key", layout_key((self.words, self.epoch)))

    def check(self) -> None:
        """The per-call check: ``words`` and ``epoch`` as validated at construction (``layout_key``)."""
        if layout_key((self.words, self.epoch)) != self._key:
            raise InputError(f"WriteMarks buffers were resized or replaced since they were built "
                             "(their shape, strides, dtype, device or address changed): "
                             f"{changed_buffers(('marks.words', 'marks.epoch'), (self.words, self.epoch), self._key)}"
                             "; use WriteMarks.allocate")

    @classmethod
    def allocate(cls, num_slots: int, device: torch.device | str = "cpu") -> WriteMarks:
        if num_slots < 2:
            raise InputError(f"num_slots {num_slots} < 2; slot 0 is reserved, so a pool needs at least 2 slots")
        return cls(torch.full((2, num_slots), UNMARKED, dtype=torch.int64, device=device),
                   torch.zeros(1, dtype=torch.int64, device=device))

    @property
    def num_slots(self) -> int:
        return self.words.shape[1]

    def set_epoch(self, epoch: int) -> None:
        """Restart the marks at ``epoch`` (0 <= epoch < EPOCH_LIMIT): every word unmarked, as a fresh
        allocation. For tests that run launches across the restart (``EPOCH_LIMIT - 2``, say);
        outside any CUDA-graph capture."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch < EPOCH_LIMIT:
            raise InputError(f"epoch {epoch!r} out of range [0, EPOCH_LIMIT = {EPOCH_LIMIT})")
        self.words.fill_(UNMARKED)
        self.epoch.fill_(epoch)


def validate_marks(marks, held, num_slots: int, device: torch.device) -> None:
    if held is not None:
        check_tensor("held", held, torch.int64, 1)
        check_contiguous("held", held)  # the kernels read held[0:n] as one run of memory
        if held.device != device:
            raise InputError(f"held is on {held.device} but the state is on {device}")
    if marks is not None:
        if not isinstance(marks, WriteMarks):
            raise InputTypeError(f"marks must be a WriteMarks (WriteMarks.allocate(num_slots)), got "
                                 f"{type(marks).__name__}")
        marks.check()
        if marks.num_slots != num_slots or marks.words.device != device:
            raise InputError(f"marks cover {marks.num_slots} slots on {marks.words.device} but the state has "
                             f"{num_slots} on {device}; allocate them with WriteMarks.allocate(num_slots, device)")


def validate_held_words(held_words, held, device: torch.device) -> None:
    """``check_forward``'s ``held_words``: int64[1 + capacity], contiguous, on the state's device,
    never beside ``held``."""
    if held_words is None:
        return
    if held is not None:
        raise InputError("held and held_words are two forms of one input; pass one of them, got both")
    check_tensor("held_words", held_words, torch.int64, 1)
    check_contiguous("held_words", held_words)  # the kernel reads the count and the slots as one run
    if held_words.shape[0] < 1:
        raise InputError("held_words length 0 < 1; it starts with the count word (int64[1 + capacity])")
    if held_words.device != device:
        raise InputError(f"held_words is on {held_words.device} but the state is on {device}")


def counted_held(held_words: torch.Tensor) -> torch.Tensor:
    """The slots ``held_words`` holds: int64[capacity], the first ``count`` (word 0, clamped to
    [0, capacity]) of the words after it, then 0 (no slot, which no check marks). Queued on the
    device, no sync."""
    slots = held_words[1:]
    count = held_words[:1].clamp(0, slots.shape[0])
    live = torch.arange(slots.shape[0], device=slots.device) < count
    return torch.where(live, slots, torch.zeros_like(slots))


def validate_writes(state, plan, out_cache_loc, input_ids, positions, req_pool_indices, write_offsets, lut, held,
                    marks, tag):
    tag = validate_ring(state, tag)
    validate_plan_buffers(plan, state.device)
    validate_marks(marks, held, state.num_slots, state.device)
    for name, t in (("out_cache_loc", out_cache_loc), ("input_ids", input_ids), ("positions", positions),
                    ("req_pool_indices", req_pool_indices), ("write_offsets", write_offsets)):
        check_tensor(name, t, torch.int64, 1)
    check_lut(lut)
    if held is not None:
        check_tensor("held", held, torch.int64, 1)
    check_same_device(records=state.records, out_cache_loc=out_cache_loc, input_ids=input_ids, positions=positions,
                      req_pool_indices=req_pool_indices, write_offsets=write_offsets, lut=lut)
    n = input_ids.shape[0]
    check_len("out_cache_loc", out_cache_loc, n, "len(input_ids)")
    check_len("positions", positions, n, "len(input_ids)")
    validate_offsets("write_offsets", write_offsets, req_pool_indices.shape[0], n)
    for name, t in (("out_cache_loc", out_cache_loc), ("input_ids", input_ids), ("positions", positions),
                    ("req_pool_indices", req_pool_indices), ("write_offsets", write_offsets), ("held", held)):
        if t is not None:  # on every backend, so that both refuse what the kernel cannot read
            check_contiguous(name, t)
    return tag


def _writes_torch(plan, loc, ids, pos, rpi, woff, lut, held, num_slots, ring, counter, tag):
    n, bs = ids.shape[0], rpi.shape[0]
    if n == 0 or bs == 0:
        return
    t = torch.arange(n, device=ids.device)
    r = searchsorted_right(woff[1:], t)
    has = r < bs
    row = torch.where(has, rpi[r.clamp(max=bs - 1)], torch.zeros_like(r))
    slot = _translate_torch(loc, lut)
    ok = has & (slot > 0) & (slot < num_slots)
    key = torch.where(ok, slot, torch.full_like(slot, num_slots))  # bucket num_slots: not checked
    first = torch.full((num_slots + 1,), n, dtype=torch.int64, device=ids.device).scatter_reduce(0, key, t, "amin")
    m = min(max(int(plan.count[0]), 0), plan.capacity) if int(plan.enable[0]) != 0 else 0
    e_slot = plan.slot[:m].to(torch.int64)
    e_key = torch.where((e_slot > 0) & (e_slot < num_slots), e_slot, torch.full_like(e_slot, num_slots))
    reader = torch.full((num_slots + 1,), UNMARKED, dtype=torch.int64, device=ids.device)
    reader.scatter_reduce_(0, e_key, plan.row[:m].to(torch.int64), "amin")
    if held is not None and held.numel():
        h_key = torch.where((held > 0) & (held < num_slots), held, torch.full_like(held, num_slots))
        reader.scatter_reduce_(0, h_key, torch.zeros_like(held), "amin")
    f = first[key]
    dup = ok & (f != t)
    rd = ok & (reader[key] != UNMARKED)
    reasons = dup.to(torch.int64) * WRITE_CONFLICT + rd.to(torch.int64) * READ_CONFLICT
    other = torch.where(dup, row[f.clamp(max=n - 1)], reader[key])
    append_violations_torch(ring, counter, reasons != 0, tag, [slot, pos, ids, torch.full_like(ids, -1), row, other,
                                                               reasons])


@triton.jit
def mark_slots(marks_ptr, slot, ok, value, key, num_slots, WHICH: tl.constexpr):
    """Fold ``key | value`` into mark word WHICH (0 writers, 1 readers) of each valid slot."""
    m = ok & (slot > 0) & (slot < num_slots)
    tl.atomic_min(marks_ptr + WHICH * num_slots + tl.where(m, slot, 0), key | value, mask=m)


@triton.jit
def conflict_lanes(marks_ptr, woff_ptr, rpi_ptr, ring_ptr, counter_ptr, ring_cap, tag, key, t, has, slot, row, pos,
                   ids, bs, num_slots, NBITS: tl.constexpr):
    """The checks of the module doc on one block of written tokens, once every mark is in."""
    ok = has & (slot > 0) & (slot < num_slots)
    s = tl.where(ok, slot, 0)
    wmark = tl.load(marks_ptr + s, mask=ok, other=0)
    rmark = tl.load(marks_ptr + num_slots + s, mask=ok, other=0)
    first = wmark & 0xFFFFFFFF
    dup = ok & ((wmark - first) == key) & (first != t)
    rd = ok & ((rmark - (rmark & 0xFFFFFFFF)) == key)
    r_first = find_segment(woff_ptr + 1, first, bs, NBITS)
    first_row = tl.load(rpi_ptr + tl.minimum(r_first, bs - 1), mask=dup & (r_first < bs), other=0)
    reasons = dup.to(tl.int64) * 128 + rd.to(tl.int64) * 256
    other = tl.where(dup, first_row, rmark & 0xFFFFFFFF)
    append_violations(ring_ptr, counter_ptr, ring_cap, reasons != 0, tag, slot, pos, ids, tl.zeros_like(ids) - 1, row,
                      other, reasons)


@triton.jit
def epoch_key(epoch):
    """The high word of this launch's marks: smaller every launch, never the unmarked word's
    (for 0 <= epoch < EPOCH_LIMIT: from 2**31 - 2 down to -2**31)."""
    return (2147483646 - epoch) << 32


@triton.jit
def advance_epoch(marks_ptr, epoch_ptr, key, num_slots):
    """Open the next launch's epoch, once every program of this one is done with the marks
    (``key``: this launch's, ``epoch_key``): epoch + 1, an atomic add nothing waits for; where
    this launch's epoch was the last below EPOCH_LIMIT (its key the smallest int64), then every
    mark word UNMARKED and epoch 0. The restart is one program's pass over the marks, once every
    EPOCH_LIMIT launches; every other launch pays one compare."""
    tl.atomic_add(epoch_ptr, 1, sem="release")
    if key == -9223372036854775807 - 1:  # epoch_key(EPOCH_LIMIT - 1)
        lane = tl.arange(0, 1024).to(tl.int64)
        words = 2 * num_slots
        for c in range(0, words, 1024):
            tl.store(marks_ptr + c + lane, tl.full([1024], 9223372036854775807, tl.int64), mask=c + lane < words)
        tl.debug_barrier()
        tl.atomic_xchg(epoch_ptr, 0, sem="release")


@triton.jit
def _advance_kernel(marks_ptr, epoch_ptr, num_slots):
    """One program: ``advance_epoch`` after ``check_writes``' two kernels."""
    advance_epoch(marks_ptr, epoch_ptr, epoch_key(tl.load(epoch_ptr)), num_slots)


@triton.jit
def _mark_kernel(loc_ptr, woff_ptr, lut_ptr, pslot_ptr, prow_ptr, count_ptr, enable_ptr, held_ptr, marks_ptr,
                 epoch_ptr, n, bs, cap, n_held, num_slots, lut_len, HAS_LUT: tl.constexpr, NBITS: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Program p marks written tokens, plan entries and held slots [p*BLOCK, (p+1)*BLOCK)."""
    pid = tl.program_id(0).to(tl.int64)
    key = epoch_key(tl.load(epoch_ptr))
    i = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    live = i < n
    r = find_segment(woff_ptr + 1, i, bs, NBITS)
    slot = _translate(tl.load(loc_ptr + i, mask=live, other=0), lut_ptr, lut_len, HAS_LUT)
    mark_slots(marks_ptr, slot, live & (r < bs), i, key, num_slots, 0)
    limit = tl.minimum(tl.maximum(tl.load(count_ptr), 0), cap)
    limit = tl.where(tl.load(enable_ptr) != 0, limit, 0)
    e = i < limit
    mark_slots(marks_ptr, tl.load(pslot_ptr + i, mask=e, other=0).to(tl.int64), e,
               tl.load(prow_ptr + i, mask=e, other=0).to(tl.int64), key, num_slots, 1)
    h = i < n_held
    mark_slots(marks_ptr, tl.load(held_ptr + i, mask=h, other=0), h, tl.zeros_like(i), key, num_slots, 1)


@triton.jit
def _writes_kernel(loc_ptr, ids_ptr, pos_ptr, rpi_ptr, woff_ptr, lut_ptr, marks_ptr, epoch_ptr, ring_ptr, counter_ptr,
                   n, bs, num_slots, lut_len, ring_cap, tag, HAS_LUT: tl.constexpr, NBITS: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Program p checks written tokens [p*BLOCK, (p+1)*BLOCK) against the marks."""
    pid = tl.program_id(0).to(tl.int64)
    key = epoch_key(tl.load(epoch_ptr))
    t = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    live = t < n
    r = find_segment(woff_ptr + 1, t, bs, NBITS)
    has = live & (r < bs)
    row = tl.load(rpi_ptr + r, mask=has, other=0)
    slot = _translate(tl.load(loc_ptr + t, mask=live, other=0), lut_ptr, lut_len, HAS_LUT)
    conflict_lanes(marks_ptr, woff_ptr, rpi_ptr, ring_ptr, counter_ptr, ring_cap, tag, key, t, has, slot, row,
                   tl.load(pos_ptr + t, mask=live, other=0), tl.load(ids_ptr + t, mask=live, other=0), bs, num_slots,
                   NBITS)


def check_writes(*, state: DeviceState, plan: Plan, out_cache_loc: torch.Tensor, input_ids: torch.Tensor,
                 positions: torch.Tensor, req_pool_indices: torch.Tensor, write_offsets: torch.Tensor, tag: int,
                 lut: torch.Tensor | None = None, held: torch.Tensor | None = None, marks: WriteMarks | None = None,
                 backend: Backend = Backend.AUTO) -> None:
    """Report this forward's write conflicts (see module doc) to ``state.ring``. Never raises on
    values; raises InputTypeError / InputError for wrong dtypes, shapes, devices, offsets, state,
    plan or marks, before anything is written."""
    tag = validate_writes(state, plan, out_cache_loc, input_ids, positions, req_pool_indices, write_offsets, lut, held,
                          marks, tag)
    device, num_slots, ring, ring_counter = state.device, state.num_slots, state.ring, state.ring_counter
    if not use_triton(backend, device):
        _writes_torch(plan, out_cache_loc, input_ids, positions, req_pool_indices, write_offsets, lut, held,
                      num_slots, ring, ring_counter, tag)
        return
    if marks is None:
        marks = WriteMarks.allocate(num_slots, device)
    n, bs = input_ids.shape[0], req_pool_indices.shape[0]
    n_held = held.shape[0] if held is not None else 0
    block = 1024
    lut_t = lut if lut is not None else write_offsets
    lut_len = lut.shape[0] if lut is not None else 0
    grid = max(cdiv(max(n, plan.capacity, n_held), block), 1)
    _mark_kernel[(grid,)](out_cache_loc, write_offsets, lut_t, plan.slot, plan.row, plan.count, plan.enable,
                          held if held is not None else write_offsets, marks.words, marks.epoch, n, bs,
                          plan.capacity, n_held, num_slots, lut_len, HAS_LUT=lut is not None, NBITS=num_bits(bs),
                          BLOCK=block, num_warps=4)
    _writes_kernel[(max(cdiv(n, block), 1),)](out_cache_loc, input_ids, positions, req_pool_indices, write_offsets,
                                              lut_t, marks.words, marks.epoch, ring, ring_counter, n, bs, num_slots,
                                              lut_len, ring.shape[0], tag, HAS_LUT=lut is not None,
                                              NBITS=num_bits(bs), BLOCK=block, num_warps=4)
    _advance_kernel[(1,)](marks.words, marks.epoch, num_slots, num_warps=4)
