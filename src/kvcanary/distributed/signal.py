"""The per-rank signal the ranks agree on: one int64 row per rank, computed on the device.

| column | name   | value                                                                      |
|--------|--------|----------------------------------------------------------------------------|
| 0      | ROWS   | violation rows this rank's canaries appended since its last signal         |
|        |        | (rows dropped by a full ring included)                                     |
| 1      | CODE   | OR of those rows' reason bits, ``1 << (8 + launch point)`` of each, and    |
|        |        | ALARM_BIT when the rank's watchdog fired                                   |
| 2      | DIGEST | chain digest of the step's batch (``chain_digest``), equal on every rank   |
| 3      | STEP   | the step the signal belongs to: the ranks must be in lock-step             |

Every rank writes its own row of a zeroed ``int64[world, 4]`` table and the table is all-reduced
with a sum, so each rank receives every rank's row (x + 0 is exact: the sum is an all-gather).
"""

from __future__ import annotations

import torch

from kvcanary.core.hashing import splitmix64_torch, to_signed
from kvcanary.core.record import (
    CHAIN,
    COL_REASONS,
    COL_TAG,
    LAUNCH_TAG_MASK,
    POSITION,
    TOKEN,
    LaunchPoint,
    Reason,
    record_words,
)

ROWS, CODE, DIGEST, STEP = range(4)
SIGNAL_WIDTH = 4
POINT_SHIFT = 8  # CODE bits 8.. : launch points of the rows
ALARM_BIT = 1 << 12  # CODE: the rank's watchdog fired
_CODE_BITS = 13
_ROW_SALT = to_signed(0xD1B54A32D192ED03)
_TOKEN_SALT = to_signed(0x9E3779B97F4A7C15)
_POSITION_SALT = to_signed(0xC2B2AE3D27D4EB4F)


def chain_digest(canary: torch.Tensor, req_pool_indices: torch.Tensor, extend_lens: torch.Tensor,
                 out_cache_loc: torch.Tensor) -> torch.Tensor:
    """int64[1] digest of a batch's newest records, computed on the canary's device.

    For request i (page-table row ``row_i``, padding rows 0 skipped) whose newest slot ``s_i`` is
    ``out_cache_loc[last token of i]``, holding (token t_i, position p_i, chain c_i): the chain with
    the newest token identifies the request's whole token sequence, and the digest is
    ``sum_i splitmix64(c_i + t_i * G1 + p_i * G2 + (row_i * G3 ^ i))`` (mod 2**64). The chain is
    content-only, so ranks that hold the same sequences in the same batch order agree on it.
    Call after HEAD stamped the batch. An empty batch digests to 0.
    """
    if extend_lens.numel() == 0:
        return torch.zeros(1, dtype=torch.int64, device=canary.device)
    words = record_words(canary)
    last = torch.cumsum(extend_lens, 0) - 1
    rec = words[out_cache_loc[last].clamp(0, words.shape[0] - 1)]
    rows = req_pool_indices.to(torch.int64)
    key = (rows * _ROW_SALT) ^ torch.arange(rows.numel(), device=rows.device)
    mixed = splitmix64_torch(rec[:, CHAIN] + rec[:, TOKEN] * _TOKEN_SALT + rec[:, POSITION] * _POSITION_SALT + key)
    return (mixed * (rows != 0)).sum().reshape(1)


class RingSummary:
    """Summarises the violation rows a canary appended to its ring between two counter values:
    how many, and the OR of their reason and launch-point bits. ``masked`` (default: on CUDA)
    masks the whole ring with the bounds on the device, without a host sync; otherwise only the
    new rows are read (the bounds are read on the host: free on the CPU)."""

    def __init__(self, ring: torch.Tensor, masked: bool | None = None):
        self.ring = ring
        self.masked = ring.is_cuda if masked is None else masked
        dev = ring.device
        self._index = torch.arange(ring.shape[0], dtype=torch.int64, device=dev)
        self._bits = torch.arange(_CODE_BITS, dtype=torch.int64, device=dev)

    def __call__(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, code), int64[1] each, of ring rows ``[lo, hi)`` (counter values, int64[1]);
        rows past the ring's capacity count but carry no bits."""
        rows = (hi - lo).clamp(min=0)
        if self.masked:
            ring = self.ring
        else:
            first, last = int(lo), min(int(hi), self.ring.shape[0])
            if last <= first:
                return rows, torch.zeros(1, dtype=torch.int64)
            ring = self.ring[first:last]
        codes = ring[:, COL_REASONS] | (1 << (POINT_SHIFT + (ring[:, COL_TAG].clamp(min=0) & LAUNCH_TAG_MASK) // 4))
        if self.masked:
            codes = torch.where((self._index >= lo) & (self._index < hi), codes, 0)
        present = ((codes[:, None] >> self._bits) & 1).amax(0)
        return rows, (present << self._bits).sum().reshape(1)


def decode_code(code: int) -> tuple[Reason, tuple[LaunchPoint, ...], bool]:
    """(reasons, launch points, watchdog alarm) of a CODE value."""
    points = tuple(p for p in LaunchPoint if code >> (POINT_SHIFT + int(p)) & 1)
    return Reason(code & ((1 << POINT_SHIFT) - 1)), points, bool(code & ALARM_BIT)
