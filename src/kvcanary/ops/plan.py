"""build_plan: from a forward's page table to a fixed-capacity verify plan and a write plan.

Verify plan (one entry per prefix slot a request reads; capacity fixed at allocation):

| buffer    | dtype / shape   | entry e of request r at position p                          |
|-----------|-----------------|-------------------------------------------------------------|
| slot      | int32[cap]      | T(req_to_token[row, p]); -1 = unresolvable (reported)       |
| pred      | int32[cap]      | T(req_to_token[row, p-1]) for p > 0, else -1                |
| position  | int32[cap]      | p                                                           |
| token     | int32[cap]      | truth[row, p] when known, else -1                           |
| entry     | int32[cap]      | req_to_token[row, p] as it is (names a bad entry)           |
| row       | int32[cap]      | the request's page-table row                                |
| count     | int64[1]        | entries requested (may exceed cap)                          |
| enable    | int32[1]        | 1 when count <= cap; 0 disables this step's verify          |
| overflow  | int64[1]        | steps whose verify was disabled by overflow (cumulative)    |

Request r reads positions [lo, P) with P = clamp(prefix_lens[r], 0, max_ctx) and lo = 0, or
lo = max(P - window, 0) with a sliding window. Padding requests (row 0) read nothing. Entries
are request after request (``verify_offsets``); entries at index >= min(count, cap) are left as
they were. ``T`` maps a page-table slot to the pool's slot: the identity, or ``lut[slot]`` for
a sliding-window pool; a result of 0 (padding slot or evicted from the window) or a slot outside
the LUT becomes -1, which ``verify`` reports.

Write plan: ``write_offsets`` int64[bs+1] (exclusive sum of extend_lens: request r writes tokens
[off[r], off[r+1])) and ``seed`` int64[bs] (T of the last prefix slot, or -1 for a sequence
head or padding), from which ``stamp`` continues the chain.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from kvcanary.errors import InputError, InputTypeError
from kvcanary.ops._common import (
    Backend,
    cdiv,
    changed_buffers,
    check_aligned,
    check_buffers,
    check_contiguous,
    check_count,
    check_len,
    check_lut,
    check_programs,
    check_same_device,
    check_table,
    check_tensor,
    is_host,
    layout_key,
    num_bits,
    searchsorted_right,
    tl,
    triton,
    use_triton,
)
from kvcanary.ops._jit import find_segment


@dataclass(frozen=True)
class Plan:
    """Preallocated plan buffers; fill with ``build_plan``. ``max_bs`` bounds the batch size."""

    slot: torch.Tensor
    pred: torch.Tensor
    position: torch.Tensor
    token: torch.Tensor
    count: torch.Tensor
    enable: torch.Tensor
    overflow: torch.Tensor
    verify_offsets: torch.Tensor
    write_offsets: torch.Tensor
    seed: torch.Tensor
    entry: torch.Tensor
    row: torch.Tensor

    def __post_init__(self):
        """Every buffer 1-D, contiguous, of its dtype, on one device; entry buffers of one length
        >= 1; scalars of length 1; offsets of length max_bs + 1 (a hand-built plan included)."""
        check_buffers("Plan", self, dict(_PLAN_FIELDS), {}, "")
        cap, max_bs = self.slot.shape[0], self.seed.shape[0]
        if cap < 1 or max_bs < 1:
            raise InputError(f"Plan capacity {cap} and max_bs {max_bs} must be >= 1; use Plan.allocate")
        check_buffers("Plan", self, {}, dict(pred=cap, position=cap, token=cap, entry=cap, row=cap, count=1,
                                             enable=1, overflow=1, verify_offsets=max_bs + 1,
                                             write_offsets=max_bs + 1),
                      f"capacity {cap}, max_bs {max_bs}")
        for name, _ in _PLAN_FIELDS:
            t = getattr(self, name)
            check_aligned(f"Plan.{name}", t, t.element_size(), "the kernels read whole words")
        # kept beside the plan, not in it: vars(plan) and dataclasses.replace see the fields alone
        _PLAN_KEYS[id(self)] = layout_key(self.tensors())
        weakref.finalize(self, _PLAN_KEYS.pop, id(self), None)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The twelve buffers, in field order."""
        return tuple(getattr(self, name) for name, _ in _PLAN_FIELDS)

    def check(self) -> None:
        """The per-call check: the buffers validated at construction, unchanged (``layout_key``:
        addresses, shapes, strides, dtypes, devices); a resized ``enable`` or ``overflow``, two
        swapped fields or a restrided column are refused before a kernel indexes them."""
        tensors = self.tensors()
        key = _PLAN_KEYS.get(id(self))
        if layout_key(tensors) != key:
            raise InputError(f"plan buffers were resized or replaced since the Plan was built "
                             "(their shape, strides, dtype, device or address changed): "
                             f"{changed_buffers(_PLAN_NAMES, tensors, key)}; use Plan.allocate")

    @classmethod
    def allocate(cls, capacity: int, max_bs: int, device: torch.device | str = "cpu") -> Plan:
        check_count("plan capacity", capacity)
        check_count("plan max_bs", max_bs)
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        cols = torch.zeros(6, capacity, **i32)  # slot, pred, position, token, entry, row: ``entry_columns``
        cols[1].fill_(-1)
        cols[3].fill_(-1)
        return cls(cols[0], cols[1], cols[2], cols[3], torch.zeros(1, **i64), torch.zeros(1, **i32),
                   torch.zeros(1, **i64), torch.zeros(max_bs + 1, **i64), torch.zeros(max_bs + 1, **i64),
                   torch.full((max_bs,), -1, **i64), cols[4], cols[5])

    def entry_columns(self) -> torch.Tensor | None:
        """The int32 [6, capacity] block ``slot | pred | position | token | entry | row`` when the six
        lie back to back in it in that order, as ``allocate`` lays them out (one copy fills a plan's
        entries); None for buffers built apart."""
        cols = (self.slot, self.pred, self.position, self.token, self.entry, self.row)
        base, cap, storage = self.slot.data_ptr(), self.capacity, self.slot.untyped_storage()
        if any(c.data_ptr() != base + 4 * cap * i or c.untyped_storage().data_ptr() != storage.data_ptr()
               for i, c in enumerate(cols)) or storage.nbytes() < (self.slot.storage_offset() + 6 * cap) * 4:
            return None
        return self.slot.as_strided((6, cap), (cap, 1), self.slot.storage_offset())

    @property
    def capacity(self) -> int:
        return self.slot.shape[0]

    @property
    def max_bs(self) -> int:
        return self.seed.shape[0]


_PLAN_FIELDS = (("slot", torch.int32), ("pred", torch.int32), ("position", torch.int32), ("token", torch.int32),
                ("count", torch.int64), ("enable", torch.int32), ("overflow", torch.int64),
                ("verify_offsets", torch.int64), ("write_offsets", torch.int64), ("seed", torch.int64),
                ("entry", torch.int32), ("row", torch.int32))
_PLAN_NAMES = tuple(f"plan.{name}" for name, _ in _PLAN_FIELDS)
_PLAN_KEYS: dict[int, tuple] = {}  # id(plan) -> its layout_key when built (Plan.check)


def validate_plan_buffers(plan, device: torch.device) -> None:
    """A Plan (validated when built) on ``device`` whose buffers still have their shapes."""
    if not isinstance(plan, Plan):
        raise InputTypeError(f"plan must be a Plan (Plan.allocate(...)), got {type(plan).__name__}")
    plan.check()
    if plan.slot.device != device:
        raise InputError(f"plan is on {plan.slot.device} but the state is on {device}")


def validate_plan(req_pool_indices, prefix_lens, extend_lens, req_to_token, plan, truth, truth_lens, lut, window):
    device = validate_batch(req_pool_indices, prefix_lens, extend_lens, req_to_token, truth, truth_lens, lut, window)
    validate_plan_buffers(plan, device)
    bs = req_pool_indices.shape[0]
    if bs > plan.max_bs:
        raise InputError(f"batch size {bs} > plan max_bs ({plan.max_bs}); allocate the plan with a larger max_bs")
    return device


def validate_batch(req_pool_indices, prefix_lens, extend_lens, req_to_token, truth, truth_lens, lut, window):
    """The batch half of a plan's inputs: dtypes, ranks, lengths, devices; rows and lengths in
    range for host tensors."""
    check_tensor("req_pool_indices", req_pool_indices, torch.int64, 1)
    check_tensor("prefix_lens", prefix_lens, torch.int64, 1)
    check_tensor("extend_lens", extend_lens, torch.int64, 1)
    check_tensor("req_to_token", req_to_token, torch.int32, 2)
    if (truth is None) != (truth_lens is None):
        raise InputError("truth and truth_lens go together: pass both or neither")
    if truth is not None:
        check_tensor("truth", truth, torch.int32, 2)
        check_tensor("truth_lens", truth_lens, torch.int64, 1)
    check_lut(lut)
    check_window(window)
    device = check_same_device(req_pool_indices=req_pool_indices, prefix_lens=prefix_lens, extend_lens=extend_lens,
                               req_to_token=req_to_token, truth=truth, truth_lens=truth_lens, lut=lut)
    for name, t in (("req_pool_indices", req_pool_indices), ("prefix_lens", prefix_lens),
                    ("extend_lens", extend_lens), ("truth_lens", truth_lens), ("lut", lut)):
        if t is not None:
            check_contiguous(name, t)
    check_table("req_to_token", req_to_token)
    if truth is not None:
        check_table("truth", truth)
    bs = req_pool_indices.shape[0]
    check_len("prefix_lens", prefix_lens, bs, "bs")
    check_len("extend_lens", extend_lens, bs, "bs")
    if truth_lens is not None:
        check_len("truth_lens", truth_lens, bs, "bs")
    rows, max_ctx = req_to_token.shape
    if truth is not None and truth.shape[0] != rows:  # a shape: checked on every device
        raise InputError(f"truth rows {truth.shape[0]} != req_to_token rows ({rows})")
    if is_host(req_pool_indices) and not _batch_values_ok(req_pool_indices, prefix_lens, extend_lens, rows, max_ctx):
        for name, bad in (("req_pool_indices", (req_pool_indices < 0) | (req_pool_indices >= rows)),
                          ("prefix_lens", (prefix_lens < 0) | (prefix_lens > max_ctx)),
                          ("extend_lens", extend_lens < 0),
                          # compared without the sum, which wraps for lengths near 2**63
                          ("prefix_lens + extend_lens", extend_lens > max_ctx - prefix_lens)):
            if bool(bad.any()):
                i = int(torch.nonzero(bad)[0])
                raise InputError(f"{name}[{i}] out of range (req_pool_indices {int(req_pool_indices[i])}, "
                                 f"prefix_lens {int(prefix_lens[i])}, extend_lens {int(extend_lens[i])}; "
                                 f"rows {rows}, max_ctx {max_ctx})")
    return device


def _batch_values_ok(req_pool_indices, prefix_lens, extend_lens, rows: int, max_ctx: int) -> bool:
    """All of ``validate_batch``'s host value checks at once, in numpy (a few microseconds; the
    torch calls cost ~30 us a batch): the detailed checks run only when one fails."""
    rpi, pre, ext = req_pool_indices.numpy(), prefix_lens.numpy(), extend_lens.numpy()
    return bool(((rpi >= 0) & (rpi < rows) & (pre >= 0) & (pre <= max_ctx) & (ext >= 0)
                 & (ext <= max_ctx - pre)).all())


def check_window(window) -> int:
    """The sliding window of a pool: an int in [0, 2**62) (0 = full attention)."""
    if isinstance(window, bool) or not isinstance(window, int):
        raise InputTypeError(f"window must be an int, got {type(window).__name__}; use 0 for full attention")
    if not 0 <= window < 2**62:
        raise InputError(f"window {window} < 0; use 0 for full attention" if window < 0 else
                         f"window {window} >= 2**62; a window longer than any context is 0 (full attention)")
    return window


def _translate_torch(slots: torch.Tensor, lut: torch.Tensor | None) -> torch.Tensor:
    s = slots.to(torch.int64)
    if lut is not None:
        ok = (s >= 0) & (s < lut.shape[0])
        s = torch.where(ok, lut[s.clamp(0, max(lut.shape[0] - 1, 0))], torch.full_like(s, -1))
    return torch.where(s == 0, torch.full_like(s, -1), s)


def _plan_torch(rpi, prefix_lens, extend_lens, rtt, plan, truth, truth_lens, lut, window):
    bs = rpi.shape[0]
    rows, max_ctx = rtt.shape
    cap = plan.capacity
    active = (rpi >= 1) & (rpi < rows)
    row = rpi.clamp(0, rows - 1)
    p_end = prefix_lens.clamp(0, max_ctx)
    lo = (p_end - window).clamp(min=0) if window else torch.zeros_like(p_end)
    n = torch.where(active, p_end - lo, torch.zeros_like(p_end))
    voff = plan.verify_offsets[: bs + 1]
    voff[0] = 0
    torch.cumsum(n, 0, out=voff[1:])
    woff = plan.write_offsets[: bs + 1]
    woff[0] = 0
    torch.cumsum(extend_lens.clamp(min=0), 0, out=woff[1:])
    last = rtt[row, (p_end - 1).clamp(min=0)]
    plan.seed[:bs] = torch.where(active & (p_end > 0), _translate_torch(last, lut), torch.full_like(row, -1))
    total = voff[bs] if bs else torch.zeros((), dtype=torch.int64, device=rpi.device)
    fits = total <= cap
    plan.count.fill_(total)
    plan.enable.copy_(fits.to(torch.int32).reshape(1))
    plan.overflow.add_((~fits).to(torch.int64))
    m = min(int(total), cap)
    if m == 0:
        return
    e = torch.arange(m, device=rpi.device)
    r = searchsorted_right(voff[1:], e)
    p = lo[r] + (e - voff[r])
    rr = row[r]
    plan.entry[:m] = rtt[rr, p]
    plan.row[:m] = rr.to(torch.int32)
    plan.slot[:m] = _translate_torch(rtt[rr, p], lut).to(torch.int32)
    pred = _translate_torch(rtt[rr, (p - 1).clamp(min=0)], lut)
    plan.pred[:m] = torch.where(p > 0, pred, torch.full_like(pred, -1)).to(torch.int32)
    plan.position[:m] = p.to(torch.int32)
    if truth is not None:
        tw = truth.shape[1]
        known = (p < truth_lens[r]) & (p < tw)
        tok = truth[rr, p.clamp(max=tw - 1)]
        plan.token[:m] = torch.where(known, tok, torch.full_like(tok, -1))
    else:
        plan.token[:m] = -1


@triton.jit
def _translate(s, lut_ptr, lut_len, HAS_LUT: tl.constexpr):
    s = s.to(tl.int64)
    if HAS_LUT:
        ok = (s >= 0) & (s < lut_len)
        s = tl.where(ok, tl.load(lut_ptr + s, mask=ok, other=-1), -1)
    return tl.where(s == 0, -1, s)


@triton.jit
def _plan_offsets_kernel(rpi_ptr, prefix_ptr, extend_ptr, rtt_ptr, lut_ptr, voff_ptr, woff_ptr, seed_ptr,
                         count_ptr, enable_ptr, overflow_ptr, bs, rows, max_ctx, rtt_stride, lut_len, window, cap,
                         HAS_LUT: tl.constexpr, BLOCK: tl.constexpr):
    """One program scans the batch in BLOCK-wide chunks: exclusive sums of verify lengths and
    extend lengths with a running carry, seed slots, then count / enable / overflow."""
    vcarry = tl.zeros((), dtype=tl.int64)
    wcarry = tl.zeros((), dtype=tl.int64)
    for s in range(0, bs, BLOCK):
        j = s + tl.arange(0, BLOCK).to(tl.int64)
        m = j < bs
        row = tl.load(rpi_ptr + j, mask=m, other=0)
        active = m & (row >= 1) & (row < rows)
        row = tl.minimum(tl.maximum(row, 0), rows - 1)
        p_end = tl.minimum(tl.maximum(tl.load(prefix_ptr + j, mask=m, other=0), 0), max_ctx)
        lo = tl.zeros_like(p_end)
        if window > 0:
            lo = tl.maximum(p_end - window, 0)
        n = tl.where(active, p_end - lo, 0)
        ext = tl.maximum(tl.load(extend_ptr + j, mask=m, other=0), 0)
        tl.store(voff_ptr + j, vcarry + tl.cumsum(n, 0) - n, mask=m)
        tl.store(woff_ptr + j, wcarry + tl.cumsum(ext, 0) - ext, mask=m)
        last = tl.load(rtt_ptr + row * rtt_stride + tl.maximum(p_end - 1, 0), mask=active, other=0)
        seed = tl.where(active & (p_end > 0), _translate(last, lut_ptr, lut_len, HAS_LUT), -1)
        tl.store(seed_ptr + j, seed, mask=m)
        vcarry += tl.sum(n, 0)
        wcarry += tl.sum(ext, 0)
    tl.store(voff_ptr + bs, vcarry)
    tl.store(woff_ptr + bs, wcarry)
    tl.store(count_ptr, vcarry)
    fits = vcarry <= cap
    tl.store(enable_ptr, fits.to(tl.int32))
    tl.store(overflow_ptr, tl.load(overflow_ptr) + (1 - fits.to(tl.int64)))


@triton.jit
def _plan_entries_kernel(rpi_ptr, prefix_ptr, rtt_ptr, lut_ptr, truth_ptr, tlen_ptr, voff_ptr, count_ptr,
                         slot_ptr, pred_ptr, pos_ptr, tok_ptr, entry_ptr, row_ptr,
                         bs, rows, max_ctx, rtt_stride, lut_len, truth_stride,
                         truth_width, window, cap, HAS_LUT: tl.constexpr, HAS_TRUTH: tl.constexpr,
                         NBITS: tl.constexpr, BLOCK: tl.constexpr):
    """Persistent grid over entries e < min(count, cap): binary-search the request r owning e,
    p = lo[r] + e - voff[r], then resolve slot, predecessor and truth token."""
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0).to(tl.int64)
    limit = tl.minimum(tl.load(count_ptr), cap)
    for base in range(pid * BLOCK, limit, nprog * BLOCK):
        e = base + tl.arange(0, BLOCK).to(tl.int64)
        m = e < limit
        r = find_segment(voff_ptr + 1, e, bs, NBITS)
        m = m & (r < bs)
        row = tl.minimum(tl.maximum(tl.load(rpi_ptr + r, mask=m, other=0), 0), rows - 1)
        p_end = tl.minimum(tl.maximum(tl.load(prefix_ptr + r, mask=m, other=0), 0), max_ctx)
        lo = tl.zeros_like(p_end)
        if window > 0:
            lo = tl.maximum(p_end - window, 0)
        p = lo + e - tl.load(voff_ptr + r, mask=m, other=0)
        p = tl.minimum(tl.maximum(p, 0), max_ctx - 1)
        entry = tl.load(rtt_ptr + row * rtt_stride + p, mask=m, other=0)
        slot = _translate(entry, lut_ptr, lut_len, HAS_LUT)
        prev = _translate(tl.load(rtt_ptr + row * rtt_stride + tl.maximum(p - 1, 0), mask=m, other=0),
                          lut_ptr, lut_len, HAS_LUT)
        prev = tl.where(p > 0, prev, -1)
        tl.store(entry_ptr + e, entry, mask=m)
        tl.store(row_ptr + e, row.to(tl.int32), mask=m)
        tok = tl.full((BLOCK,), -1, dtype=tl.int32)
        if HAS_TRUTH:
            tlen = tl.load(tlen_ptr + r, mask=m, other=0)
            known = m & (p < tlen) & (p < truth_width)
            tok = tl.load(truth_ptr + row * truth_stride + p, mask=known, other=-1)
        tl.store(slot_ptr + e, slot.to(tl.int32), mask=m)
        tl.store(pred_ptr + e, prev.to(tl.int32), mask=m)
        tl.store(pos_ptr + e, p.to(tl.int32), mask=m)
        tl.store(tok_ptr + e, tok, mask=m)


def build_plan(*, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
               req_to_token: torch.Tensor, plan: Plan, truth: torch.Tensor | None = None,
               truth_lens: torch.Tensor | None = None, lut: torch.Tensor | None = None, window: int = 0,
               max_programs: int = 1024, backend: Backend = Backend.AUTO) -> Plan:
    """Fill ``plan`` in place for one forward (see module doc) and return it.

    Raises TypeError for wrong dtypes, ValueError for wrong ranks/lengths, a batch larger than
    ``plan.max_bs``, a negative window, and (host tensors only) rows or lengths out of range.
    """
    device = validate_plan(req_pool_indices, prefix_lens, extend_lens, req_to_token, plan, truth, truth_lens,
                           lut, window)
    check_programs(max_programs)
    if use_triton(backend, device):
        bs = req_pool_indices.shape[0]
        rows, max_ctx = req_to_token.shape
        lut_t = lut if lut is not None else plan.seed
        lut_len = lut.shape[0] if lut is not None else 0
        truth_t = truth if truth is not None else req_to_token
        tlen_t = truth_lens if truth_lens is not None else prefix_lens
        block = 1024
        _plan_offsets_kernel[(1,)](
            req_pool_indices, prefix_lens, extend_lens, req_to_token, lut_t, plan.verify_offsets, plan.write_offsets,
            plan.seed, plan.count, plan.enable, plan.overflow, bs, rows, max_ctx, req_to_token.stride(0), lut_len,
            window, plan.capacity, HAS_LUT=lut is not None, BLOCK=block, num_warps=4)
        grid = max(1, min(cdiv(plan.capacity, block), max_programs))
        _plan_entries_kernel[(grid,)](
            req_pool_indices, prefix_lens, req_to_token, lut_t, truth_t, tlen_t, plan.verify_offsets, plan.count,
            plan.slot, plan.pred, plan.position, plan.token, plan.entry, plan.row,
            bs, rows, max_ctx, req_to_token.stride(0), lut_len,
            truth_t.stride(0), truth_t.shape[1], window, plan.capacity, HAS_LUT=lut is not None,
            HAS_TRUTH=truth is not None, NBITS=num_bits(bs), BLOCK=block, num_warps=4)
    else:
        _plan_torch(req_pool_indices, prefix_lens, extend_lens, req_to_token, plan, truth, truth_lens, lut, window)
    return plan
