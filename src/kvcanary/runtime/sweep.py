"""Sweep plans: verify entries for slots nobody reads right now, within a byte budget.

A run is a stretch of consecutive positions held by a prefix cache (or loaded back from a host
tier): its slots, the tokens they hold, the position of the first, and the slot before it (-1 at
a sequence head). Successive sweeps continue where the last one stopped, so every cached slot is
visited within ``ceil(cached bytes / budget)`` sweeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SweepRun:
    slots: torch.Tensor  # int64[n]
    token_ids: Sequence[int] | None  # None: tokens unknown (not checked)
    start_position: int
    prev_slot: int = -1


def sweep_entries(runs: Sequence[SweepRun], cursor: int, max_entries: int):
    """Host lists (slot, pred, position, token) of at most ``max_entries`` entries starting at
    entry ``cursor`` (mod the total, wrapping); returns them and the next cursor."""
    slot, pred, pos, tok = [], [], [], []
    for run in runs:
        s = [int(x) for x in run.slots.tolist()]
        slot += s
        pred += [run.prev_slot, *s[:-1]]
        pos += range(run.start_position, run.start_position + len(s))
        tok += list(run.token_ids) if run.token_ids is not None else [-1] * len(s)
    total = len(slot)
    if total == 0 or max_entries <= 0:
        return ([], [], [], []), 0
    start = cursor % total
    take = min(max_entries, total)
    idx = [(start + i) % total for i in range(take)]
    pick = lambda xs: [xs[i] for i in idx]
    return (pick(slot), pick(pred), pick(pos), pick(tok)), (start + take) % total
