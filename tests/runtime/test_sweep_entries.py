"""Sweep entries built with array operations equal a plain per-entry walk over the runs, for
random runs (empty ones, unknown tokens, predecessors) and cursors that wrap."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvcanary.runtime.sweep import SweepRun, sweep_entries


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


@pytest.mark.parametrize("seed", range(40))
def test_entries_match_a_walk_over_the_runs(seed):
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
