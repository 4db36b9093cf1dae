"""Sweep plans: verify entries for slots nobody reads right now, within a byte budget.

A run is a stretch of consecutive positions held by a prefix cache (or loaded back from a host
tier): its slots, the tokens they hold, the position of the first, and the slot before it (-1 at
a sequence head). Successive sweeps continue where the last one stopped, so every cached slot is
visited within ``ceil(cached bytes / budget)`` sweeps.
"""

from __future__ import annotations

import itertools
import operator
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
    Runs on the device cost one copy to the host in all (not one per run). With ``cache``, each
    run's entries are kept between sweeps (``RunCache``): a sweep over runs it has seen is one
    concatenation."""
    runs = [r for r in runs if r.slots.numel()]
    if not runs or max_entries <= 0:
        empty = np.zeros(0, dtype=np.int64)
        if cache is not None:
            cache.last = np.zeros((4, 0), dtype=np.int64) if not runs else None
        return (empty, empty, empty, empty), 0
    entries = (cache if cache is not None else RunCache()).joined(runs)
    total = entries.shape[1]
    start = cursor % total
    take = min(max_entries, total)
    end = start + take
    window = entries[:, start:end] if end <= total else np.concatenate((entries[:, start:], entries[:, : end - total]),
                                                                        axis=1)
    return (window[0], window[1], window[2], window[3]), int(end % total)


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


def same_blocks(a: list, b: list) -> bool:
    """Whether two lists of a ``RunCache``'s blocks are the same arrays in the same order."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


class RunCache:
    """Each run's entries, an int64 [4, n] host array (slot, pred, position, token), kept from one
    sweep to the next while the run holds the same slot tensor, unchanged (same address, no write
    since: its version counter), the same tokens object of an immutable kind (a tuple, or None),
    the same first position and predecessor. A list of tokens may change in place, so it is
    converted at every sweep. A prefix cache whose nodes keep their slots and token tuples
    converts only its new nodes, all of them at once. Runs not seen in a sweep are forgotten."""

    def __init__(self):
        self._kept: dict[int, tuple] = {}
        self._joined: tuple[list, np.ndarray] | None = None  # the last sweep's blocks and their concatenation
        self.last: np.ndarray | None = None  # what the last ``joined`` returned
        self.total = 0  # the entries the last ``entries`` returned

    def joined(self, runs: list[SweepRun]) -> np.ndarray:
        """The entries of ``runs`` as one int64 [4, total] array: the last sweep's
        when its runs gave the same blocks in the same order (nothing writes these arrays)."""
        return self.concatenated(self.entries(runs))

    def concatenated(self, blocks: list[np.ndarray]) -> np.ndarray:
        """``blocks`` (this cache's, none empty) as one int64 [4, total] array: the last one made
        where they are the same blocks in the same order."""
        if not blocks:
            self.last = np.zeros((4, 0), dtype=np.int64)
            return self.last
        if len(blocks) == 1:
            self.last = blocks[0]
            return self.last
        last = self._joined
        if last is not None and same_blocks(last[0], blocks):
            self.last = last[1]
            return self.last
        out = np.concatenate(blocks, axis=1)
        self._joined = (blocks, out)
        self.last = out
        return out

    def entries(self, runs: Sequence[SweepRun]) -> list[np.ndarray]:
        """The entries of each of ``runs`` that is not empty, in order; ``total``: how many in all."""
        kept, now = self._kept, {}
        out: list = []
        missed = []  # (its place in out, the run, its length)
        total = 0
        for r in runs:
            s, toks = r.slots, r.token_ids
            hit = kept.get(id(s))
            if (hit is not None and hit[0] is s and hit[1] == s._version and hit[2] == s.data_ptr()
                    and hit[3] is toks and (toks is None or type(toks) is tuple)
                    and hit[4] == r.start_position and hit[5] == r.prev_slot):
                out.append(hit[6])
                now[id(s)] = hit
                total += hit[7]
                continue
            n = s.numel()
            if n:
                missed.append((len(out), r, n))
                out.append(None)
                total += n
        if missed:
            new = [m[1] for m in missed]
            block = _entries(new, [m[2] for m in missed], runs)
            at = 0
            for i, r, n in missed:
                out[i] = block[:, at: at + n]
                at += n
                now[id(r.slots)] = (r.slots, r.slots._version, r.slots.data_ptr(), r.token_ids, r.start_position,
                                    r.prev_slot, out[i], n)
        self._kept = now
        self.total = total
        return out


LISTED_ENTRIES = 128  # fewer new entries than this (all on the CPU): built as Python lists (``_entries``)
RANGED_ENTRIES = 4096  # up to this many, positions are counted from the runs' ranges (``_entries``)


def _entries(runs: list[SweepRun], lens: list[int], every: list[SweepRun]) -> np.ndarray:
    """The entries of ``runs`` (``lens`` slots each) as one int64 [4, total] array; a token count
    that does not match names the totals of ``every`` run of the sweep. A few entries of runs on
    the CPU are walked as Python lists into one array: a sweep converts a few new runs between a
    model's forwards, where each numpy or torch call costs several µs more than in a loop; from
    ``LISTED_ENTRIES`` on, the arrays' calls cost less than the lists' work per entry (in a loop
    on a laptop core: 89 entries 11.7 against 15.0 µs, 381 entries 46 against 24). The arrays'
    path touches as few numpy functions as it can for the same reason: between a model's
    forwards the first call of each one costs 10-25 µs (its code is out of the caches; the next
    call of the same one, about 1), so the positions come from the same ``fromiter`` as the tokens
    (up to ``RANGED_ENTRIES``; past that its per-entry cost outweighs two more functions), the
    four columns are stacked by one ``np.array``, and the run heads' predecessors are set one by
    one (the reference engine's sweeps: 25-30 % less time converting new runs than with
    ``np.empty``, a fancy-indexed store and ``np.repeat``)."""
    total = sum(lens)
    if total < LISTED_ENTRIES and all(not r.slots.is_cuda for r in runs):
        return _entries_listed(runs, lens, every)
    slot = _host_slots([r.slots for r in runs])
    try:
        tok = _tokens(runs, lens, total)
    except ValueError:
        _tokens(every, [r.slots.numel() for r in every], sum(r.slots.numel() for r in every))
        raise
    if total <= RANGED_ENTRIES:
        pos = np.fromiter(itertools.chain.from_iterable(
            range(r.start_position, r.start_position + n) for r, n in zip(runs, lens, strict=True)),
            dtype=np.int64, count=total)
    else:  # position = entry index + (the run's first position - the run's first entry)
        heads = itertools.accumulate(lens, initial=0)
        pos = np.repeat([r.start_position - h for r, h in zip(runs, heads, strict=False)], lens)  # heads: one more
        pos += np.arange(total, dtype=np.int64)
    block = np.array((slot, slot, pos, tok))
    pred = block[1]
    pred[1:] = slot[:-1]  # each slot follows the one before it, ...
    at = 0
    for r, n in zip(runs, lens, strict=True):
        pred[at] = r.prev_slot  # ... a run's first its run's predecessor
        at += n
    return block




def _entries_listed(runs: list[SweepRun], lens: list[int], every: list[SweepRun]) -> np.ndarray:
    slot, pred, pos, tok = [], [], [], []
    for r, n in zip(runs, lens, strict=True):
        s = r.slots.reshape(-1).tolist()
        slot += s
        pred.append(r.prev_slot)
        pred += s[:-1]
        pos += range(r.start_position, r.start_position + n)
        if r.token_ids is None:
            tok += [-1] * n
        elif len(r.token_ids) == n:
            tok += r.token_ids
        else:  # name the sweep's totals, as the arrays' check does
            _tokens(every, [x.slots.numel() for x in every], sum(x.slots.numel() for x in every))
            raise ValueError(f"a sweep run holds {n} slots but {len(r.token_ids)} token ids")
    return np.array((slot, pred, pos, tok), dtype=np.int64)


def _host_slots(slots: list[torch.Tensor]) -> np.ndarray:
    """The runs' slots, concatenated, as one int64 host array (runs on the device: one copy in all)."""
    flat = [t if t.dim() == 1 else t.reshape(-1) for t in slots]
    try:
        out = torch.cat(flat)
    except RuntimeError:  # on more than one device
        out = torch.cat([t.cpu() for t in flat])
    if out.dtype is not torch.int64:
        out = out.to(torch.int64)
    return (out.cpu() if out.is_cuda else out).numpy()
