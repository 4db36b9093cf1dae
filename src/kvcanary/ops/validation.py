"""The ops' input checks, public for benchmarks and the layers above: ``check_tensor`` (dtype,
rank, contiguity, device), ``check_same_device`` and ``validate_ring`` (a DeviceState's per-call
check, the launch tag and, for host tensors, the ring counter's value), and ``host_forward_ok``,
the CPU shortcut for a batch whose dtypes, ranks, lengths and device were checked when it was
built."""

from __future__ import annotations

import torch

from kvcanary.ops._common import check_same_device, check_tensor
from kvcanary.ops._ring import validate_ring

__all__ = ["check_same_device", "check_tensor", "host_forward_ok", "validate_ring"]


def host_forward_ok(rpi: torch.Tensor, ids: torch.Tensor, rtt: torch.Tensor, lut: torch.Tensor | None,
                    truth_rows: int | None, max_bs: int, max_tokens: int) -> bool:
    """Whether ``check_forward`` would accept the shapes of a batch whose dtypes, ranks, lengths and
    single device were already checked (``runtime.ForwardBatch`` does so when it is built), as far
    as they are not the compiled kernel's to check (``ops._cpu``: contiguity at the call, values
    before it writes): ``rtt`` a table with unit column stride and rows that do not overlap (of
    ``truth_rows`` rows when the truth table is used), a non-empty ``lut``, and a batch that fits
    the workspaces (``max_bs`` requests, ``max_tokens`` tokens). Raises nothing: on False the
    caller runs ``check_forward``, which raises the error that names the argument."""
    if lut is not None and lut.shape[0] < 1:
        return False
    rows, width = rtt.shape
    if rows < 1 or width < 1 or rtt.stride(1) != 1 or (rows > 1 and rtt.stride(0) < width):
        return False
    if truth_rows is not None and truth_rows != rows:
        return False
    return rpi.shape[0] <= max_bs and ids.shape[0] <= max_tokens
