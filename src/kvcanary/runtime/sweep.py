"""Sweep plans: verify entries for slots nobody reads right now, within a byte budget.

A run is a stretch of consecutive positions held by a prefix cache (or loaded back from a host
tier): its slots, the tokens they hold, the position of the first, and the slot before it (-1 at
a sequence head). Successive sweeps continue where the last one stopped, so every cached slot is
visited within ``ceil(cached bytes / budget)`` sweeps.
"""

from __future__ import annotations

import itertools
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
    lens = np.fromiter((r.slots.numel() for r in runs), dtype=np.int64, count=len(runs))
    total = int(lens.sum())
    if total == 0 or max_entries <= 0:
        empty = np.zeros(0, dtype=np.int64)
        return (empty, empty, empty, empty), 0
    slot = _host_slots([r.slots for r in runs])
    heads = np.cumsum(lens) - lens
    pred = np.empty_like(slot)
    pred[1:] = slot[:-1]
    pred[heads] = [r.prev_slot for r in runs]  # a run's first slot follows the run's predecessor
    starts = np.fromiter((r.start_position for r in runs), dtype=np.int64, count=len(runs))
    pos = np.arange(total, dtype=np.int64) + np.repeat(starts - heads, lens)
    if all(r.token_ids is not None for r in runs):
        tok = np.fromiter(itertools.chain.from_iterable(r.token_ids for r in runs), dtype=np.int64)
    else:
        tok = np.concatenate([np.asarray(r.token_ids, dtype=np.int64) if r.token_ids is not None
                              else np.full(n, -1, dtype=np.int64) for r, n in zip(runs, lens.tolist(), strict=True)])
    if tok.shape[0] != total:
        raise ValueError(f"sweep runs hold {total} slots but {tok.shape[0]} token ids; pass one token per slot")
    start = cursor % total
    take = min(max_entries, total)
    idx = (start + np.arange(take)) % total
    return (slot[idx], pred[idx], pos[idx], tok[idx]), int((start + take) % total)


def _host_slots(slots: list[torch.Tensor]) -> np.ndarray:
    """The runs' slots, concatenated, as one int64 host array (runs on the device: one copy in all)."""
    flat = [t if t.dim() == 1 else t.reshape(-1) for t in slots]
    if len({t.device for t in flat}) > 1:
        flat = [t.cpu() for t in flat]
    return torch.cat(flat).to(torch.int64).cpu().numpy()
