"""signal_row: one rank's row of the tensor-parallel agreement's table, built on the device.
Public as ``kvcanary.distributed.signal_row`` (with ``SignalBuffers``), the agreement's op.

The row (``int64[4]``) a rank contributes to the all-reduced ``int64[world, 4]`` table:

| column | name   | value                                                                        |
|--------|--------|------------------------------------------------------------------------------|
| 0      | ROWS   | violation rows the rank's rings received since its last signal (rows dropped |
|        |        | by a full ring included)                                                     |
| 1      | CODE   | OR of those rows' reason bits (bits 0..31), ``1 << (32 + launch point)`` of  |
|        |        | each row, and ALARM_BIT (bit 40) when the rank's watchdog flag is set        |
| 2      | DIGEST | chain digest of the batch just stamped (see below), 0 without a batch        |
| 3      | STEP   | ``buffers.step``, which the kernel then advances by one                      |

Inputs, all read on the device (no host sync; the launch can be captured in a CUDA graph):

| argument          | dtype / shape        | meaning                                                |
|-------------------|----------------------|--------------------------------------------------------|
| states            | n ``DeviceState``    | the rank's rings (``ring``, ``ring_counter``); the     |
|                   |                      | first one's ``records`` give the digest                |
| buffers.marks     | int64[n]             | per ring: counter value up to which rows were taken    |
| buffers.pending   | int64[2]             | rows and code taken but not signalled yet              |
| buffers.alarm     | int64[1]             | non-zero: the rank's watchdog fired (cleared on emit)  |
| buffers.step      | int64[1]             | the step of the next signal                            |
| table             | int64[world, 4]      | zeroed, then this rank's row written (emit only)       |
| req_pool_indices  | int64[bs]            | page-table row of request i (0 = padding, skipped)     |
| extend_lens       | int64[bs]            | tokens request i wrote                                 |
| out_cache_loc     | int64[T]             | slots the batch wrote                                  |

Per ring k the rows ``[marks[k], counter_k)`` are taken (their count, and the bits of those
inside the ring's capacity) and ``marks[k] = counter_k``. Without ``table`` (settle: before the
reporter may reset a counter) the rows go to ``pending``; with it (emit) ``pending`` and the
rows of every ring form the row, and ``pending``, ``alarm`` are cleared.

Chain digest: request i's newest slot is ``s_i = out_cache_loc[clamp(cumsum(extend_lens)[i] - 1,
0, T - 1)]`` (slot 0 when T == 0), clamped into the pool, holding token t_i, position p_i,
chain c_i; the digest is ``sum_i splitmix64(c_i + t_i * G1 + p_i * G2 + (row_i * G3 ^ i))``
(mod 2**64) over the requests with ``row_i != 0``. The chain is content-only, so ranks that hold
the same sequences in the same batch order agree on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcanary.core.hashing import splitmix64_torch, to_signed
from kvcanary.core.record import CHAIN, COL_REASONS, COL_TAG, POSITION, TOKEN, VIOLATION_ROW_WIDTH, LaunchPoint
from kvcanary.errors import InputError, InputTypeError
from kvcanary.ops._common import (
    Backend,
    check_buffers,
    check_contiguous,
    check_len,
    check_same_device,
    check_tensor,
    is_host,
    tl,
    triton,
    use_triton,
)
from kvcanary.ops._jit import mix64
from kvcanary.ops.state import DeviceState

ROWS, CODE, DIGEST, STEP = range(4)
SIGNAL_WIDTH = 4
REASON_MASK = (1 << 32) - 1  # CODE bits 0..31: reason bits of the rows
POINT_SHIFT = 32  # CODE bits 32..35: launch points of the rows
ALARM_BIT = 1 << 40  # CODE: the rank's watchdog fired
ROW_SALT = 0xD1B54A32D192ED03
TOKEN_SALT = 0x9E3779B97F4A7C15
POSITION_SALT = 0xC2B2AE3D27D4EB4F
BLOCK = 256
_BITS = torch.arange(41, dtype=torch.int64)  # every bit a CODE can carry
assert ALARM_BIT == 1 << 40 and POINT_SHIFT + len(LaunchPoint) <= 40


@dataclass(frozen=True, eq=False)
class SignalBuffers:
    """The device buffers ``signal_row`` keeps between steps (see the module doc); allocate
    once with ``SignalBuffers.allocate``, outside any CUDA-graph capture."""

    marks: torch.Tensor
    pending: torch.Tensor
    alarm: torch.Tensor
    step: torch.Tensor

    def __post_init__(self):
        check_buffers("SignalBuffers", self, dict.fromkeys(("marks", "pending", "alarm", "step"), torch.int64),
                      {"pending": 2, "alarm": 1, "step": 1}, "pending 2, alarm 1, step 1")
        if self.marks.shape[0] < 1:
            raise InputError("SignalBuffers.marks length 0 < 1; allocate one mark per ring")

    @classmethod
    def allocate(cls, num_rings: int, device: torch.device | str = "cpu") -> SignalBuffers:
        if isinstance(num_rings, bool) or not isinstance(num_rings, int) or num_rings < 1:
            raise InputError(f"num_rings {num_rings!r} must be an int >= 1 (one mark per ring)")
        z = lambda n: torch.zeros(n, dtype=torch.int64, device=device)  # noqa: E731
        return cls(z(num_rings), z(2), z(1), z(1))

    @property
    def device(self) -> torch.device:
        return self.marks.device


def validate_signal(states, buffers, table, rank, req_pool_indices, extend_lens, out_cache_loc) -> torch.device:
    if isinstance(states, DeviceState) or not isinstance(states, Sequence) or not states:
        raise InputTypeError(f"states must be a non-empty sequence of DeviceState, got {type(states).__name__}")
    for i, s in enumerate(states):
        if not isinstance(s, DeviceState):
            raise InputTypeError(f"states[{i}] must be a DeviceState, got {type(s).__name__}")
        s.check()
    if not isinstance(buffers, SignalBuffers):
        raise InputTypeError(f"buffers must be a SignalBuffers, got {type(buffers).__name__}")
    if buffers.marks.shape[0] != len(states):
        raise InputError(f"buffers.marks length {buffers.marks.shape[0]} != len(states) ({len(states)}); "
                         "allocate SignalBuffers.allocate(len(states))")
    devices = {f"states[{i}].records": s.records for i, s in enumerate(states)}
    devices["buffers.marks"] = buffers.marks
    if table is not None:
        check_tensor("table", table, torch.int64, 2)
        check_contiguous("table", table)
        if table.shape[1] != SIGNAL_WIDTH or table.shape[0] < 1:
            raise InputError(f"table shape {tuple(table.shape)} != (world, {SIGNAL_WIDTH}); "
                             f"allocate torch.zeros(world, {SIGNAL_WIDTH}, dtype=torch.int64)")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < table.shape[0]:
            raise InputError(f"rank {rank!r} out of range [0, {table.shape[0]}) (table rows = world size)")
        devices["table"] = table
    batch = (req_pool_indices, extend_lens, out_cache_loc)
    if any(t is not None for t in batch):
        if table is None:
            raise InputError("a batch was passed without table; the digest is written only when emitting")
        for name, t in zip(("req_pool_indices", "extend_lens", "out_cache_loc"), batch, strict=True):
            if t is None:
                raise InputError(f"{name} is None but the other batch tensors were passed; pass all three or none")
            check_tensor(name, t, torch.int64, 1)
            check_contiguous(name, t)
            devices[name] = t
        check_len("extend_lens", extend_lens, req_pool_indices.shape[0], "len(req_pool_indices)")
        if is_host(extend_lens) and bool((extend_lens < 0).any()):
            i = int(torch.nonzero(extend_lens < 0)[0])
            raise InputError(f"extend_lens[{i}] = {int(extend_lens[i])} < 0")
    return check_same_device(**devices)


# --- torch path ----------------------------------------------------------------------------------

def _ring_bits(state: DeviceState, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """int64[1]: OR of the code bits of ring rows [lo, min(hi, capacity))."""
    ring = state.ring
    if is_host(ring):
        first, last = max(int(lo), 0), min(int(hi), ring.shape[0])
        rows = ring[first:last] if last > first else ring[:0]
    else:  # no host read: mask the whole ring with the device bounds
        rows = ring
    codes = (rows[:, COL_REASONS] & REASON_MASK) | (1 << (POINT_SHIFT + (rows[:, COL_TAG].clamp(min=0) // 4) % 4))
    if not is_host(ring):
        index = torch.arange(ring.shape[0], device=ring.device)
        codes = torch.where((index >= lo) & (index < hi), codes, 0)
    present = ((codes[:, None] >> _BITS.to(codes.device)) & 1).amax(0) if codes.numel() else 0
    return (present << _BITS.to(codes.device)).sum().reshape(1).to(torch.int64)


def digest_torch(records: torch.Tensor, req_pool_indices: torch.Tensor, extend_lens: torch.Tensor,
                 out_cache_loc: torch.Tensor) -> torch.Tensor:
    """int64[1]: the chain digest of the module doc."""
    bs, n = req_pool_indices.shape[0], out_cache_loc.shape[0]
    if bs == 0:
        return torch.zeros(1, dtype=torch.int64, device=records.device)
    words = records.view(torch.int64)
    last = (torch.cumsum(extend_lens, 0) - 1).clamp(0, max(n - 1, 0))
    slots = out_cache_loc[last] if n else torch.zeros(bs, dtype=torch.int64, device=records.device)
    rec = words[slots.clamp(0, words.shape[0] - 1)]
    rows = req_pool_indices
    key = (rows * to_signed(ROW_SALT)) ^ torch.arange(bs, device=rows.device)
    mixed = splitmix64_torch(rec[:, CHAIN] + rec[:, TOKEN] * to_signed(TOKEN_SALT)
                             + rec[:, POSITION] * to_signed(POSITION_SALT) + key)
    return (mixed * (rows != 0)).sum().reshape(1)


def _signal_torch(states, buffers, table, rank, batch) -> None:
    if all(is_host(s.ring) for s in states):
        _signal_host(states, buffers, table, rank, batch)
        return
    rows = torch.zeros(1, dtype=torch.int64, device=buffers.device)
    code = torch.zeros(1, dtype=torch.int64, device=buffers.device)
    for k, s in enumerate(states):
        lo, hi = buffers.marks[k:k + 1], s.ring_counter
        rows += (hi - lo).clamp(min=0)
        code |= _ring_bits(s, lo, hi)
        buffers.marks[k:k + 1].copy_(hi)
    if table is None:
        buffers.pending[0:1] += rows
        buffers.pending[1:2] |= code
        return
    table.zero_()
    mine = table[rank]
    mine[ROWS:ROWS + 1].copy_(rows + buffers.pending[0:1])
    mine[CODE:CODE + 1].copy_(code | buffers.pending[1:2] | torch.where(buffers.alarm != 0, ALARM_BIT, 0))
    if batch is not None:
        mine[DIGEST:DIGEST + 1].copy_(digest_torch(states[0].records, *batch))
    mine[STEP:STEP + 1].copy_(buffers.step)
    buffers.step.add_(1)
    buffers.pending.zero_()
    buffers.alarm.zero_()


def _signal_host(states, buffers, table, rank, batch) -> None:
    """The torch path on host tensors: the scalars through numpy views (reading them is free
    here), the ring rows and the digest vectorised."""
    marks, pending = buffers.marks.numpy(), buffers.pending.numpy()
    rows, code = 0, 0
    for k, s in enumerate(states):
        lo, hi = int(marks[k]), int(s.ring_counter[0])
        rows += max(hi - lo, 0)
        if min(hi, s.ring.shape[0]) > max(lo, 0):
            code |= int(_ring_bits(s, lo, hi))
        marks[k] = hi
    if table is None:
        pending[0] += rows
        pending[1] |= code
        return
    out, alarm, step = table.numpy(), buffers.alarm.numpy(), buffers.step.numpy()
    digest = int(digest_torch(states[0].records, *batch)) if batch is not None else 0
    out[:] = 0
    out[rank] = (rows + int(pending[0]), code | int(pending[1]) | (ALARM_BIT if alarm[0] else 0), digest, step[0])
    step[0] += 1
    pending[:] = 0
    alarm[0] = 0


# --- Triton kernel ----------------------------------------------------------------------------------

@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _signal_kernel(ring_ptr, counter_ptr, mark_ptr, pending_ptr, alarm_ptr, step_ptr, table_ptr, words_ptr,
                   rpi_ptr, ext_ptr, ocl_ptr, capacity, num_slots, bs, num_tokens, rank, world,
                   EMIT: tl.constexpr, HAS_BATCH: tl.constexpr, BLOCK: tl.constexpr):
    """One program. Ring part: lanes walk ring rows [mark, min(counter, capacity)) BLOCK at a
    time, OR-ing each row's code; the count is counter - mark. Emit part: request i of the batch
    on lane i % BLOCK of chunk i // BLOCK, its newest token found by a running cumsum."""
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    lo = tl.load(mark_ptr)
    hi = tl.load(counter_ptr)
    rows = tl.maximum(hi - lo, 0)
    last = tl.minimum(hi, capacity)
    code = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(tl.maximum(lo, 0), last, BLOCK):
        i = start + lanes
        m = i < last
        tag = tl.load(ring_ptr + i * 8 + 0, mask=m, other=0)
        reasons = tl.load(ring_ptr + i * 8 + 7, mask=m, other=0)
        point = (tl.maximum(tag, 0) // 4) % 4
        c = (reasons & tl.full([BLOCK], 0xFFFFFFFF, tl.int64)) | (tl.full([BLOCK], 1, tl.int64) << (32 + point))
        code = code | tl.where(m, c, 0)
    code_all = tl.reduce(code, 0, _or)
    tl.store(mark_ptr, hi)
    if EMIT:
        rows += tl.load(pending_ptr)
        code_all = code_all | tl.load(pending_ptr + 1)
        alarm = tl.load(alarm_ptr)
        code_all = code_all | ((alarm != 0).to(tl.int64) << 40)
        digest = tl.zeros([BLOCK], dtype=tl.uint64)
        if HAS_BATCH:
            run = tl.zeros([], dtype=tl.int64)
            for start in range(0, bs, BLOCK):
                j = start + lanes
                m = j < bs
                e = tl.load(ext_ptr + j, mask=m, other=0)
                t = tl.cumsum(e, 0) + run - 1
                run += tl.sum(e, 0)
                t = tl.minimum(tl.maximum(t, 0), tl.maximum(num_tokens - 1, 0))
                slot = tl.load(ocl_ptr + t, mask=m & (t < num_tokens), other=0)  # T == 0: slot 0
                slot = tl.minimum(tl.maximum(slot, 0), num_slots - 1)
                tok = tl.load(words_ptr + slot * 4 + 0, mask=m, other=0).to(tl.uint64, bitcast=True)
                pos = tl.load(words_ptr + slot * 4 + 1, mask=m, other=0).to(tl.uint64, bitcast=True)
                chain = tl.load(words_ptr + slot * 4 + 2, mask=m, other=0).to(tl.uint64, bitcast=True)
                row = tl.load(rpi_ptr + j, mask=m, other=0)
                key = (row.to(tl.uint64, bitcast=True) * 0xD1B54A32D192ED03) ^ j.to(tl.uint64, bitcast=True)
                mixed = mix64(chain + tok * 0x9E3779B97F4A7C15 + pos * 0xC2B2AE3D27D4EB4F + key)
                digest += tl.where(m & (row != 0), mixed, 0)
        cells = tl.arange(0, 4 * BLOCK).to(tl.int64)
        for start in range(0, world * 4, 4 * BLOCK):
            tl.store(table_ptr + start + cells, tl.zeros([4 * BLOCK], dtype=tl.int64), mask=start + cells < world * 4)
        mine = table_ptr + rank * 4
        tl.store(mine + 0, rows)
        tl.store(mine + 1, code_all)
        tl.store(mine + 2, tl.sum(digest, 0).to(tl.int64, bitcast=True))
        step = tl.load(step_ptr)
        tl.store(mine + 3, step)
        tl.store(step_ptr, step + 1)
        tl.store(pending_ptr, 0)
        tl.store(pending_ptr + 1, 0)
        tl.store(alarm_ptr, 0)
    else:
        tl.store(pending_ptr, tl.load(pending_ptr) + rows)
        tl.store(pending_ptr + 1, tl.load(pending_ptr + 1) | code_all)


def _signal_triton(states, buffers, table, rank, batch) -> None:
    records = states[0].records
    rpi, ext, ocl = batch if batch is not None else (buffers.marks,) * 3  # dummies: HAS_BATCH=False
    for k, s in enumerate(states):
        emit = table is not None and k == len(states) - 1
        _signal_kernel[(1,)](
            s.ring, s.ring_counter, buffers.marks[k:], buffers.pending, buffers.alarm, buffers.step,
            table if emit else buffers.pending, records.view(torch.int64), rpi, ext, ocl, s.ring.shape[0],
            records.shape[0], rpi.shape[0] if batch is not None else 0, ocl.shape[0] if batch is not None else 0,
            rank if emit else 0, table.shape[0] if emit else 0, EMIT=emit, HAS_BATCH=emit and batch is not None,
            BLOCK=BLOCK, num_warps=4)


def signal_row(*, states: Sequence[DeviceState], buffers: SignalBuffers, table: torch.Tensor | None = None,
               rank: int = 0, req_pool_indices: torch.Tensor | None = None, extend_lens: torch.Tensor | None = None,
               out_cache_loc: torch.Tensor | None = None, backend: Backend = Backend.AUTO) -> None:
    """Take the new rows of every ring of ``states``; with ``table``, write this ``rank``'s row of
    it (zeroing the rest) from them, ``buffers`` and the batch (see the module doc); without it,
    keep them in ``buffers.pending``. Writes ``buffers`` (and ``table``) in place; one kernel
    launch per ring on CUDA, no host sync, no allocation: capturable in a CUDA graph.

    Raises InputTypeError / InputError naming the argument for wrong types, dtypes, shapes,
    devices, a rank outside the table, a partial batch, and (host tensors) negative extend_lens.
    """
    batch = (req_pool_indices, extend_lens, out_cache_loc)
    device = validate_signal(states, buffers, table, rank, *batch)
    batch = batch if req_pool_indices is not None else None
    if use_triton(backend, device):
        _signal_triton(states, buffers, table, rank, batch)
    else:
        _signal_torch(states, buffers, table, rank, batch)


assert VIOLATION_ROW_WIDTH == 8 and COL_TAG == 0 and COL_REASONS == 7  # the kernel's row offsets
assert (TOKEN, POSITION, CHAIN) == (0, 1, 2)  # the kernel's record words
