"""The per-rank signal the ranks agree on: one int64 row per rank, built on the device by one
kernel (``kvcanary.ops.signal.signal_row``; the table of its columns is there).

Every rank writes its own row of a zeroed ``int64[world, 4]`` table and the table is all-reduced
with a sum, so each rank receives every rank's row (x + 0 is exact: the sum is an all-gather).
"""

from __future__ import annotations

import torch

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.ops.signal import (
    ALARM_BIT,
    CODE,
    DIGEST,
    POINT_SHIFT,
    REASON_MASK,
    ROWS,
    SIGNAL_WIDTH,
    STEP,
    SignalBuffers,
    digest_torch,
    signal_row,
)

__all__ = ["ALARM_BIT", "CODE", "DIGEST", "POINT_SHIFT", "ROWS", "SIGNAL_WIDTH", "STEP", "SignalBuffers",
           "chain_digest", "decode_code", "signal_row"]


def chain_digest(canary: torch.Tensor, req_pool_indices: torch.Tensor, extend_lens: torch.Tensor,
                 out_cache_loc: torch.Tensor) -> torch.Tensor:
    """int64[1] digest of a batch's newest records (``canary``: uint8[num_slots, 32]), computed on
    the canary's device: the DIGEST column ``signal_row`` writes (see ``kvcanary.ops.signal``).
    Call after HEAD stamped the batch. An empty batch digests to 0."""
    return digest_torch(canary, req_pool_indices, extend_lens, out_cache_loc)


def decode_code(code: int) -> tuple[Reason, tuple[LaunchPoint, ...], bool]:
    """(reasons, launch points, watchdog alarm) of a CODE value."""
    points = tuple(p for p in LaunchPoint if code >> (POINT_SHIFT + int(p)) & 1)
    return Reason(code & REASON_MASK), points, bool(code & ALARM_BIT)
