"""Host/torch side of the violation ring shared by stamp and verify."""

from __future__ import annotations

import operator

import torch

from kvcanary.core.record import NUM_LAUNCH_TAGS
from kvcanary.errors import InputError, InputTypeError
from kvcanary.ops._common import is_host
from kvcanary.ops.state import check_state


def validate_ring(state, tag: int) -> int:
    """The state (per-call identity check) and the launch tag; on the host also the counter's
    value. Returns the tag as an int."""
    check_state(state)
    if isinstance(tag, bool):
        raise InputTypeError("tag must be an int (LaunchTag(...).value), got bool")
    try:
        tag = operator.index(tag)
    except TypeError:
        raise InputTypeError(f"tag must be an int (LaunchTag(...).value), got {type(tag).__name__}") from None
    if not 0 <= tag < NUM_LAUNCH_TAGS:
        raise InputError(f"tag {tag} out of range [0, {NUM_LAUNCH_TAGS}); pass LaunchTag(...).value")
    if is_host(state.ring_counter) and int(state.ring_counter[0]) < 0:
        raise InputError(f"state.ring_counter {int(state.ring_counter[0])} < 0; a ring counter only grows from 0")
    return tag


def append_violations_torch(ring, ring_counter, bad, tag, cols: list[torch.Tensor]) -> None:
    """Torch twin of ``_jit.append_violations``: rows in lane order after the current count;
    ``tag`` is one int or an int64 tensor of a tag per lane."""
    idx = torch.nonzero(bad).flatten()
    k = idx.numel()
    if k == 0:
        return
    base = int(ring_counter[0])
    keep = max(min(k, ring.shape[0] - base), 0) if base >= 0 else 0
    if keep:
        tags = tag[idx].to(torch.int64) if isinstance(tag, torch.Tensor) else \
            torch.full((k,), int(tag), dtype=torch.int64, device=ring.device)
        rows = torch.stack([tags]
                           + [c[idx].to(torch.int64) for c in cols], dim=1)
        ring[base: base + keep] = rows[:keep]
    ring_counter += k
