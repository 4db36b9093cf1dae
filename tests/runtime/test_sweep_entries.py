"""Sweep entries built with array operations or Python lists equal a plain per-entry walk over
the runs, for random runs (empty ones, unknown tokens, predecessors) and cursors that wrap."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvcanary.runtime import sweep
from kvcanary.runtime.sweep import RunCache, SweepRun, sweep_entries


def reference(runs, cursor, max_entries):
    entries = []
    for run in runs:
        slots = [int(x) for x in run.slots.tolist()]
        for i, slot in enumerate(slots):
            tok = run.token_ids[i] if run.token_ids is not None else -1
            entries.append((slot, slots[i - 1] if i else run.prev_slot, run.start_position + i, tok))
    if not entries or max_entries <= 0:
        return [], 0
    start = cursor % len(entries)
    take = min(max_entries, len(entries))
    return [entries[(start + i) % len(entries)] for i in range(take)], (start + take) % len(entries)


def _runs(rng: random.Random) -> list[SweepRun]:
    runs = []
    for _ in range(rng.randrange(0, 6)):
        n = rng.choice([0, 1, rng.randrange(2, 40)])
        slots = torch.tensor(rng.sample(range(1, 5000), n), dtype=rng.choice([torch.int32, torch.int64]))
        tokens = None if rng.random() < 0.3 else [rng.randrange(0, 50_000) for _ in range(n)]
        runs.append(SweepRun(slots, tokens, rng.randrange(0, 300), rng.choice([-1, rng.randrange(1, 5000)])))
    return runs


@pytest.mark.parametrize("listed,ranged", [(0, 1 << 30), (0, 0), (1 << 30, 0)],
                         ids=["arrays-ranges", "arrays-repeat", "lists"])
@pytest.mark.parametrize("seed", range(40))
def test_entries_match_a_walk_over_the_runs(seed, listed, ranged, monkeypatch):
    monkeypatch.setattr(sweep, "LISTED_ENTRIES", listed)  # new runs built by any path
    monkeypatch.setattr(sweep, "RANGED_ENTRIES", ranged)  # positions counted from ranges, or repeated heads
    rng = random.Random(seed)
    runs = _runs(rng)
    cursor, max_entries = rng.randrange(0, 500), rng.choice([0, 1, 7, 64, 10_000])
    (slot, pred, pos, tok), nxt = sweep_entries(runs, cursor, max_entries)
    want, want_next = reference(runs, cursor, max_entries)
    got = list(zip(slot.tolist(), pred.tolist(), pos.tolist(), tok.tolist(), strict=True))
    assert got == want and nxt == want_next
    assert all(a.dtype == np.int64 for a in (slot, pred, pos, tok))


def test_a_run_whose_tokens_do_not_match_its_slots_is_refused():
    runs = [SweepRun(torch.tensor([3, 4, 5]), [1, 2], 0)]
    with pytest.raises(ValueError, match="3 slots but 2 token ids"):
        sweep_entries(runs, 0, 10)


@pytest.mark.parametrize("seed", range(12))
def test_a_cache_gives_the_same_entries_across_sweeps_whatever_changed(seed):
    """Sweeps through one RunCache equal the walk at every sweep while runs' slots are written in
    place, runs are replaced, dropped and added, and tuple or list tokens change."""
    rng = random.Random(seed)
    cache = RunCache()
    runs = [SweepRun(r.slots, tuple(r.token_ids) if r.token_ids is not None and rng.random() < 0.7 else r.token_ids,
                     r.start_position, r.prev_slot) for r in _runs(rng)]
    cursor = 0
    for _ in range(6):
        max_entries = rng.choice([1, 7, 64, 10_000])
        (slot, pred, pos, tok), nxt = sweep_entries(runs, cursor, max_entries, cache)
        want, want_next = reference(runs, cursor, max_entries)
        assert list(zip(slot.tolist(), pred.tolist(), pos.tolist(), tok.tolist(), strict=True)) == want
        assert nxt == want_next
        cursor = nxt
        blocks = cache.entries(runs)  # empty runs too: skipped (what a whole sweep passes)
        assert cache.total == sum(b.shape[1] for b in blocks) == sum(r.slots.numel() for r in runs)
        got = np.concatenate(blocks, axis=1).T.tolist() if blocks else []
        assert got == [list(e) for e in reference(runs, 0, 1 << 30)[0]]
        for i, r in enumerate(list(runs)):
            change = rng.random()
            if change < 0.2 and r.slots.numel():
                r.slots[rng.randrange(r.slots.numel())] = rng.randrange(1, 5000)  # in place: version bump
            elif change < 0.3 and isinstance(r.token_ids, list) and r.token_ids:
                r.token_ids[0] += 1  # a list changed in place
            elif change < 0.4 and r.token_ids is not None:
                runs[i] = SweepRun(r.slots, tuple(t + 1 for t in r.token_ids), r.start_position, r.prev_slot)
        if rng.random() < 0.3 and runs:
            runs.pop(rng.randrange(len(runs)))
        runs += _runs(rng)[:1]


def test_a_cached_sweep_names_every_runs_totals_when_tokens_do_not_match():
    cache = RunCache()
    good = SweepRun(torch.tensor([7, 8]), (1, 2), 0)
    sweep_entries([good], 0, 10, cache)
    with pytest.raises(ValueError, match="5 slots but 4 token ids"):
        sweep_entries([good, SweepRun(torch.tensor([3, 4, 5]), (1, 2), 0)], 0, 10, cache)
