"""export_host_rows: the canary rows of device slots, written straight into host rows.

| argument    | dtype / shape              | meaning                                                  |
|-------------|----------------------------|----------------------------------------------------------|
| records     | uint8[num_slots, 32]       | ``DeviceState.records``                                  |
| source_tags | int64[num_slots]           | ``DeviceState.source_tags`` (one side word a slot)       |
| slots       | int64[n], host             | the slots whose rows travel                              |
| rows        | int64[n], host             | the host row each one goes to                            |
| host        | uint8[num_rows, 40], host  | the host rows, written in place                          |

Host row ``rows[i]`` gets slot ``slots[i]``'s row: its 32-byte record, then its 8-byte side word
(``core.record.ROW_BYTES``), as ``export_rows`` gives it. Where ``rows`` repeats a row, the
last entry naming it wins (as a host loop over the entries would). Every index is checked
before anything is written.

On CUDA the kernel reads ``slots`` and ``rows`` from pinned host memory and writes ``host``
(pinned too) through its device mapping: one launch, no staging copy and no synchronisation,
where the torch path gathers on the device, copies the rows to the host and scatters them
there. The caller orders its own host reads of ``host`` after the launch (an event).
"""

from __future__ import annotations

import numpy as np
import torch

from kvcanary.core.record import RECORD_BYTES, ROW_BYTES
from kvcanary.errors import InputError
from kvcanary.ops._common import (
    Backend,
    cdiv,
    check_contiguous,
    check_len,
    check_same_device,
    check_tensor,
    tl,
    triton,
    use_triton,
)
from kvcanary.ops.launcher import Fixed, launch

BLOCK = 256
_RECORD_WORDS, _ROW_WORDS = RECORD_BYTES // 8, ROW_BYTES // 8


def validate_export(records, source_tags, slots, rows, host) -> tuple[np.ndarray, np.ndarray]:
    """Check every argument; returns ``slots`` and ``rows`` as numpy views."""
    check_tensor("records", records, torch.uint8, 2)
    check_tensor("source_tags", source_tags, torch.int64, 1)
    check_tensor("slots", slots, torch.int64, 1)
    check_tensor("rows", rows, torch.int64, 1)
    check_tensor("host", host, torch.uint8, 2)
    if records.shape[1] != RECORD_BYTES:
        raise InputError(f"records must be uint8[num_slots, {RECORD_BYTES}], got shape {tuple(records.shape)}")
    if host.shape[1] != ROW_BYTES:
        raise InputError(f"host must be uint8[num_rows, {ROW_BYTES}], got shape {tuple(host.shape)}")
    num_slots = records.shape[0]
    check_len("source_tags", source_tags, num_slots, "records rows")
    check_len("rows", rows, slots.shape[0], "len(slots)")
    check_same_device(records=records, source_tags=source_tags)
    for name, t in (("slots", slots), ("rows", rows), ("host", host)):
        if t.device.type != "cpu":
            raise InputError(f"{name} must be on the host (cpu), got {t.device}")
        check_contiguous(name, t)
    for name, t in (("records", records), ("source_tags", source_tags)):
        check_contiguous(name, t)
    s, r = slots.numpy(), rows.numpy()
    for name, v, hi in (("slots", s, num_slots), ("rows", r, host.shape[0])):
        if v.size and (v.min() < 0 or v.max() >= hi):
            i = int(np.flatnonzero((v < 0) | (v >= hi))[0])
            raise InputError(f"{name}[{i}] = {int(v[i])} out of range [0, {hi})")
    return s, r


def _last_of_each_row(s: np.ndarray, r: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The entries that win where ``r`` repeats a row (the last naming it), in order; None when
    no row repeats."""
    if np.unique(r).size == r.size:
        return None
    _, first_from_end = np.unique(r[::-1], return_index=True)
    keep = np.sort(r.size - 1 - first_from_end)
    return s[keep], r[keep]


def _export_torch(records, source_tags, slots, rows, host) -> None:
    index = slots.to(records.device)
    moved = torch.cat([records[index], source_tags[index].view(torch.uint8).view(-1, ROW_BYTES - RECORD_BYTES)],
                      dim=1)
    host[rows] = moved.to(host.device)


@triton.jit(do_not_specialize=["n"])
def _export_kernel(rec_ptr, tag_ptr, host_ptr, slot_ptr, row_ptr, n, RECORD_WORDS: tl.constexpr,
                   ROW_WORDS: tl.constexpr, BLOCK: tl.constexpr):
    """Entry i = p*BLOCK + lane: host row rows[i] (int64 words) = record words of slots[i], then
    its side word."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = i < n
    s = tl.load(slot_ptr + i, mask=m, other=0)
    r = tl.load(row_ptr + i, mask=m, other=0)
    for w in tl.static_range(RECORD_WORDS):
        tl.store(host_ptr + r * ROW_WORDS + w, tl.load(rec_ptr + s * RECORD_WORDS + w, mask=m, other=0), mask=m)
    tl.store(host_ptr + r * ROW_WORDS + RECORD_WORDS, tl.load(tag_ptr + s, mask=m, other=0), mask=m)


def export_host_rows(*, records: torch.Tensor, source_tags: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
                     host: torch.Tensor, backend: Backend = Backend.AUTO) -> None:
    """Write each slot's row into its host row (module doc). On the Triton path with ``records``
    on CUDA, ``slots``, ``rows`` and ``host`` must be pinned (``pin_memory``). Raises
    InputTypeError / InputError for a wrong argument, before anything is written."""
    s, r = validate_export(records, source_tags, slots, rows, host)
    if not len(s):
        return
    triton_path = use_triton(backend, records.device)
    if triton_path and records.is_cuda:
        for name, t in (("slots", slots), ("rows", rows), ("host", host)):
            if not t.is_pinned():
                raise InputError(f"{name} must be pinned host memory for the kernel to reach it; "
                                 f"pass {name}.pin_memory()")
    launch_export(records, source_tags, slots, rows, host, triton_path)


def export_fixed(records: torch.Tensor, source_tags: torch.Tensor, host: torch.Tensor) -> Fixed:
    """The kernel's leading arguments (one state's records and side words, one host mirror), keyed
    once for ``launch_export``'s ``fixed`` (ops.launcher)."""
    return Fixed(_export_kernel, (records.view(torch.int64), source_tags, host.view(torch.int64)))


def launch_export(records: torch.Tensor, source_tags: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
                  host: torch.Tensor, triton_path: bool, fixed: Fixed | None = None) -> None:
    """``export_host_rows`` of arguments it has checked (non-empty; pinned for the kernel on CUDA):
    a repeated row keeps its last entry alone, then the kernel (through ``fixed``, from
    ``export_fixed`` of the same three tensors, when given) or the torch path."""
    last = _last_of_each_row(slots.numpy(), rows.numpy())
    if last is not None:  # a repeated row: its last entry alone (pinned copies for the kernel)
        slots, rows = (torch.from_numpy(np.ascontiguousarray(v)) for v in last)
        if triton_path and records.is_cuda:
            slots, rows = slots.pin_memory(), rows.pin_memory()
    n = slots.shape[0]
    if not triton_path:
        _export_torch(records, source_tags, slots, rows, host)
        return
    lead = () if fixed is not None else (records.view(torch.int64), source_tags, host.view(torch.int64))
    launch(_export_kernel, (cdiv(n, BLOCK),), (*lead, slots, rows, n),
           {"RECORD_WORDS": _RECORD_WORDS, "ROW_WORDS": _ROW_WORDS, "BLOCK": BLOCK}, fixed=fixed)
