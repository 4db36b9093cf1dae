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
    token_ids: Sequence[int] | None  # None: tokens unknown (not checked); a tuple is kept between sweeps
    start_position: int
    prev_slot: int = -1


def sweep_entries(runs: Sequence[SweepRun], cursor: int, max_entries: int, cache: RunCache | None = None):
    """Host arrays (slot, pred, position, token), int64, of at most ``max_entries`` entries
    starting at entry ``cursor`` (mod the total, wrapping); returns them and the next cursor.
    Runs on the device cost one copy to the host in all (not one per run). With ``cache``, a
    run's slot and token arrays are kept between sweeps (``RunCache``)."""
    runs = [r for r in runs if r.slots.numel()]
    lens = np.fromiter((r.slots.numel() for r in runs), dtype=np.int64, count=len(runs))
    total = int(lens.sum())
    if total == 0 or max_entries <= 0:
        empty = np.zeros(0, dtype=np.int64)
        return (empty, empty, empty, empty), 0
    if cache is not None:
        slot, tok = cache.arrays(runs, total)
    else:
        slot, tok = _host_slots([r.slots for r in runs]), _tokens(runs, lens.tolist(), total)
    heads = np.cumsum(lens) - lens
    pred = np.empty_like(slot)
    pred[1:] = slot[:-1]
    pred[heads] = [r.prev_slot for r in runs]  # a run's first slot follows the run's predecessor
    starts = np.fromiter((r.start_position for r in runs), dtype=np.int64, count=len(runs))
    pos = np.arange(total, dtype=np.int64) + np.repeat(starts - heads, lens)
    start = cursor % total
    take = min(max_entries, total)
    return tuple(_window(a, start, take) for a in (slot, pred, pos, tok)), int((start + take) % total)


def _window(a: np.ndarray, start: int, take: int) -> np.ndarray:
    """``take`` elements of ``a`` from ``start`` on, wrapping at its end (``take <= len(a)``)."""
    end = start + take
    if end <= a.shape[0]:
        return a[start:end]
    return np.concatenate((a[start:], a[: end - a.shape[0]]))


def _tokens(runs: list[SweepRun], lens: list[int], total: int) -> np.ndarray:
    """The runs' token ids, concatenated (-1 where a run's are unknown), as one int64 array."""
    if all(r.token_ids is not None for r in runs):
        tok = np.fromiter(itertools.chain.from_iterable(r.token_ids for r in runs), dtype=np.int64)
    else:
        tok = np.concatenate([np.asarray(r.token_ids, dtype=np.int64) if r.token_ids is not None
                              else np.full(n, -1, dtype=np.int64) for r, n in zip(runs, lens, strict=True)])
    if tok.shape[0] != total:
        raise ValueError(f"sweep runs hold {total} slots but {tok.shape[0]} token ids; pass one token per slot")
    return tok


class RunCache:
    """Each run's slots and tokens as int64 host arrays, kept from one sweep to the next while
    the run holds the same slot tensor, unchanged (same address, no write since: its version
    counter) and the same tokens object of an immutable kind (a tuple, or None). A list of
    tokens may change in place, so it is converted at every sweep. A prefix cache whose nodes
    keep their slots and token tuples converts only its new nodes. Runs not seen in a sweep are
    forgotten."""

    def __init__(self):
        self._kept: dict[int, tuple] = {}

    def arrays(self, runs: list[SweepRun], total: int) -> tuple[np.ndarray, np.ndarray]:
        kept, now = self._kept, {}
        parts: list = [None] * len(runs)
        missed = []
        for i, r in enumerate(runs):
            s, toks = r.slots, r.token_ids
            hit = kept.get(id(s))
            if (hit is not None and hit[0] is s and hit[1] == s._version and hit[2] == s.data_ptr()
                    and hit[3] is toks and (toks is None or type(toks) is tuple)):
                parts[i] = hit[4]
                now[id(s)] = hit
            else:
                missed.append(i)
        if missed:
            lens = [runs[i].slots.numel() for i in missed]
            slots = _host_slots([runs[i].slots for i in missed])
            try:
                toks = _tokens([runs[i] for i in missed], lens, sum(lens))
            except ValueError:  # name the totals of every run, as without a cache
                _tokens(runs, [r.slots.numel() for r in runs], total)
                raise
            at = 0
            for i, n in zip(missed, lens, strict=True):
                r = runs[i]
                arrays = (slots[at: at + n], toks[at: at + n])
                at += n
                parts[i] = arrays
                now[id(r.slots)] = (r.slots, r.slots._version, r.slots.data_ptr(), r.token_ids, arrays)
        self._kept = now
        slot = np.concatenate([a[0] for a in parts])
        tok = np.concatenate([a[1] for a in parts])
        return slot, tok


def _host_slots(slots: list[torch.Tensor]) -> np.ndarray:
    """The runs' slots, concatenated, as one int64 host array (runs on the device: one copy in all)."""
    flat = [t if t.dim() == 1 else t.reshape(-1) for t in slots]
    if len({t.device for t in flat}) > 1:
        flat = [t.cpu() for t in flat]
    return torch.cat(flat).to(torch.int64).cpu().numpy()
