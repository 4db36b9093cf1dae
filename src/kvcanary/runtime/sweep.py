"""Sweep plans: verify entries for slots nobody reads right now, within a byte budget.

A run is a stretch of consecutive positions held by a prefix cache (or loaded back from a host
tier): its slots, the tokens they hold, the position of the first, and the slot before it (-1 at
a sequence head). Successive sweeps continue where the last one stopped, so every cached slot is
visited within ``ceil(cached bytes / budget)`` sweeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SweepRun:
    slots: torch.Tensor  # int64[n]
    token_ids: Sequence[int] | None  # None: tokens unknown (not checked)
    start_position: int
    prev_slot: int = -1


def sweep_entries(runs: Sequence[SweepRun], cursor: int, max_entries: int):
    """Host arrays (slot, pred, position, token), int64, of at most ``max_entries`` entries
    starting at entry ``cursor`` (mod the total, wrapping); returns them and the next cursor.
    Runs on the device cost one copy to the host in all (not one per run)."""
    runs = [r for r in runs if r.slots.numel()]
    lens = [int(r.slots.shape[0]) for r in runs]
    total = sum(lens)
    if total == 0 or max_entries <= 0:
        empty = np.zeros(0, dtype=np.int64)
        return (empty, empty, empty, empty), 0
    slots = [r.slots.reshape(-1).to(torch.int64) for r in runs]
    slot = torch.cat([t.cpu() for t in slots] if len({t.device for t in slots}) > 1 else slots).cpu().numpy()
    heads = np.cumsum([0, *lens[:-1]])
    pred = np.empty_like(slot)
    pred[1:] = slot[:-1]
    pred[heads] = [r.prev_slot for r in runs]  # a run's first slot follows the run's predecessor
    pos = np.arange(total, dtype=np.int64) + np.repeat([r.start_position - h for r, h in zip(runs, heads,
                                                                                              strict=True)], lens)
    tok = np.concatenate([np.asarray(r.token_ids, dtype=np.int64) if r.token_ids is not None
                          else np.full(n, -1, dtype=np.int64) for r, n in zip(runs, lens, strict=True)])
    if tok.shape[0] != total:
        raise ValueError(f"sweep runs hold {total} slots but {tok.shape[0]} token ids; pass one token per slot")
    start = cursor % total
    take = min(max_entries, total)
    idx = (start + np.arange(take)) % total
    return (slot[idx], pred[idx], pos[idx], tok[idx]), int((start + take) % total)
