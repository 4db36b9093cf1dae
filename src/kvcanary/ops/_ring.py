"""Host/torch side of the violation ring shared by stamp and verify."""

from __future__ import annotations

import torch

from kvcanary.core.record import NUM_LAUNCH_TAGS, NUM_STATS, VIOLATION_ROW_WIDTH
from kvcanary.ops._common import check_same_device, check_tensor


def validate_ring(ring, ring_counter, stats, tag: int) -> None:
    check_tensor("ring", ring, torch.int64, 2)
    if ring.shape[1] != VIOLATION_ROW_WIDTH or not ring.is_contiguous():
        raise ValueError(f"ring must be a contiguous int64[capacity, {VIOLATION_ROW_WIDTH}], got shape "
                         f"{tuple(ring.shape)}; allocate it with core.record.new_ring")
    check_tensor("ring_counter", ring_counter, torch.int64, 1)
    check_tensor("stats", stats, torch.int64, 2)
    if tuple(stats.shape) != (NUM_LAUNCH_TAGS, NUM_STATS):
        raise ValueError(f"stats shape {tuple(stats.shape)} != ({NUM_LAUNCH_TAGS}, {NUM_STATS}); "
                         "allocate it with core.record.new_stats")
    if not 0 <= int(tag) < NUM_LAUNCH_TAGS:
        raise ValueError(f"tag {int(tag)} out of range [0, {NUM_LAUNCH_TAGS}); pass LaunchTag(...).value")
    check_same_device(ring=ring, ring_counter=ring_counter, stats=stats)


def append_violations_torch(ring, ring_counter, bad, tag, cols: list[torch.Tensor]) -> None:
    """Torch twin of ``_jit.append_violations``: rows in lane order after the current count."""
    idx = torch.nonzero(bad).flatten()
    k = idx.numel()
    if k == 0:
        return
    base = int(ring_counter[0])
    keep = max(min(k, ring.shape[0] - base), 0)
    if keep:
        rows = torch.stack([torch.full((k,), int(tag), dtype=torch.int64, device=ring.device)]
                           + [c[idx].to(torch.int64) for c in cols], dim=1)
        ring[base: base + keep] = rows[:keep]
    ring_counter += k
