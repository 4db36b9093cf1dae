"""A sweep over the entries its plan holds already (the same runs, unchanged, swept again) launches
the verify on the plan as it is, copying nothing, and still reports damage done since; anything
else that loads the plan (a landed copy's check) makes the next sweep load its own entries again.
On the CPU through the ops one by one and through the interpreted Triton kernels, and on CUDA."""

from __future__ import annotations

import pytest
import torch

from kvcanary.core.record import FINGERPRINT, Reason, record_words
from kvcanary.errors import KVCanaryError
from kvcanary.runtime.sweep import SweepRun
from kvcanary.runtime.sweep_graphs import SMALLEST, STEP, _count_word, class_sizes, staging_words

from ._helpers import PATHS, prefilled, read_all

NUM_SLOTS, CTX = 300, 64


@pytest.mark.parametrize("device,fused", PATHS)
@pytest.mark.parametrize("seed", [5, 6])
def test_a_sweep_over_the_entries_its_plan_holds_copies_nothing_and_still_reports_damage(seed, device, fused,
                                                                                         monkeypatch):
    c, slots, tokens = prefilled(seed, device, NUM_SLOTS, CTX, 12, 256, fused)
    keep = 2
    runs = [SweepRun(torch.tensor(s[keep:], dtype=torch.int64), tuple(t[keep:]), keep, s[keep - 1])
            for s, t in zip(slots, tokens, strict=True)]  # one list, swept again and again
    loads = []
    load = c.sweeper.load
    monkeypatch.setattr(c.sweeper, "load", lambda *cols: loads.append(len(cols[0])) or load(*cols))
    graphs = c.sweeper.graphs
    if graphs is not None:  # CUDA: runs that fit whole are staged by the graphs' ``load_blocks``
        load_blocks = graphs.load_blocks
        monkeypatch.setattr(graphs, "load_blocks", lambda blocks, m: loads.append(m) or load_blocks(blocks, m))
    n = c.sweep(runs)
    assert n == sum(len(s) - keep for s in slots) and loads == [n]
    assert c.sweep(runs) == n and loads == [n]  # launched on the plan as it is
    assert read_all(c, 1) == []
    bad = slots[0][keep + 3]
    record_words(c.state.records)[bad, FINGERPRINT] ^= 1 << 9  # its own word only: no successor's chain moves
    assert c.sweep(runs) == n and loads == [n]
    assert [(v.slot, v.point.name, v.reasons) for v in read_all(c, 3)] == [(bad, "SWEEP", Reason.FINGERPRINT)]
    record_words(c.state.records)[bad, FINGERPRINT] ^= 1 << 9  # repaired
    c.verify_landed(torch.tensor(slots[2][:4]))  # loads the plan with other entries ...
    assert c.sweep(runs) == n and loads == [n, 4, n]  # ... so the next sweep loads its own again
    want = [(s, s_[i - 1], i, t) for s_, t_ in zip(slots, tokens, strict=True)
            for i, (s, t) in enumerate(zip(s_, t_, strict=True)) if i >= keep]
    p = c.sweep_plan
    assert list(zip(p.slot[:n].tolist(), p.pred[:n].tolist(), p.position[:n].tolist(), p.token[:n].tolist(),
                    strict=True)) == want
    assert read_all(c, 5) == []
    runs[1] = SweepRun(runs[1].slots.clone(), runs[1].token_ids, keep, runs[1].prev_slot)  # another tensor
    assert c.sweep(runs) == n and loads == [n, 4, n, n]  # new arrays: loaded, though the values are the same


@pytest.mark.parametrize("device,fused", PATHS)
def test_a_sweep_that_holds_holds_every_slot_of_its_runs_whatever_its_budget(device, fused):
    """``sweep(runs, hold=True)`` holds what ``hold`` of the runs' concatenated slots would: every
    slot of every run (empty runs skipped), also when the budget lets the sweep verify only a few;
    then a write into one of them is a READ_CONFLICT at the HEAD that follows."""
    c, slots, tokens = prefilled(7, device, NUM_SLOTS, CTX, 12, 256, fused)
    runs = [SweepRun(torch.tensor(s[1:], dtype=torch.int64), tuple(t[1:]), 1, s[0])
            for s, t in zip(slots, tokens, strict=True)]
    runs.insert(1, SweepRun(torch.zeros(0, dtype=torch.int64), (), 0))
    every = torch.cat([r.slots for r in runs])
    for budget in (None, 3 * c.entry_bytes(), 0):
        c.held = None
        c.sweep(runs, budget, hold=True)
        assert c.held is not None and c.held.tolist() == every.tolist()
    c.sweep([], hold=True)
    assert c.held is not None and c.held.numel() == 0
    held = c.held
    with pytest.raises(KVCanaryError, match=r"sweep hold must be True or False, got 1"):
        c.sweep(runs, hold=1)
    assert c.held is held  # refused before the sweep did anything
    free = sorted(set(range(1, NUM_SLOTS)) - set(sum(slots, [])))
    c.sweep(runs, hold=True)
    assert _write(c, device, free[:2], 8) == []  # the clean twin: no write into a held slot
    c.verify_landed(torch.tensor(slots[2][:4]))  # loads the plan with other entries
    c.sweep(runs, hold=True)  # loads its own again
    assert c.held.tolist() == every.tolist()
    c.sweep(runs, hold=True)  # the plan as it is, its runs held again
    assert c.held.tolist() == every.tolist()
    target = slots[2][5]
    found = _write(c, device, [free[2], target], 9)
    conflicts = [(v.slot, v.point.name) for v in found if v.reasons & Reason.READ_CONFLICT]
    assert conflicts == [(target, "HEAD")]


def _write(c, device: str, slots: list[int], token: int) -> list:
    """One forward of a new request in page-table row 1 (its table replaced) writing ``slots`` at
    positions 0, 1, ...; the violations it reports."""
    from kvcanary.runtime.batch import ForwardBatch

    i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=device)
    table = torch.zeros(4, CTX, dtype=torch.int32)
    table[1, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
    b = ForwardBatch(i64([1]), i64([0]), i64([len(slots)]), table.to(device), i64([token] * len(slots)),
                     i64(list(range(len(slots)))), i64(slots))
    c.prepare_head(b)
    c.launch_head(b)
    return read_all(c, 10)


@pytest.mark.parametrize("capacity", [1, 2, 255, 256, 257, 300, 1001, 4096, 65536, 65537])
def test_the_sweep_graphs_classes_cover_the_plan_and_their_counts_sit_aligned_after_their_rows(capacity):
    """Each class of ``runtime.sweep_graphs`` (the smallest one holding a sweep's entries is
    replayed): increasing, the last the plan's capacity, its count word even (an int64 view) and
    past its five rows, all within the staging words allocated for the plan."""
    sizes = class_sizes(capacity)
    assert sizes[-1] == capacity and sizes == sorted(set(sizes)) and sizes[0] == min(SMALLEST, capacity)
    assert all(b <= a * STEP for a, b in zip(sizes[:-1], sizes[1:], strict=True))
    for m in sizes:
        c = _count_word(m)
        assert c % 2 == 0 and 5 * m <= c <= 5 * m + 1 and c + 2 <= staging_words(capacity)
    assert staging_words(capacity) - 2 == _count_word(capacity)


@pytest.mark.parametrize("device,fused", PATHS)
def test_a_landed_copy_longer_than_the_sweep_plan_is_verified_whole(device, fused):
    """``verify_landed`` of more slots than the sweep plan holds (a long prefix loaded back)
    verifies them a plan at a time, each against the one before it across the cuts: a record
    damaged past the first cut is reported at SWEEP, naming the slot; its clean twin reports
    nothing."""
    c, slots, _ = prefilled(13, device, NUM_SLOTS, CTX, 50, 256, fused, plan_capacity=16)
    run = slots[1]  # one row, landed whole: every slot but its first follows the one before
    assert c.verify_landed(torch.tensor(run)) == len(run) > 3 * 16
    assert read_all(c, 1) == []
    bad = run[40]  # in the third cut
    record_words(c.state.records)[bad, FINGERPRINT] ^= 1 << 5
    assert c.verify_landed(torch.tensor(run)) == len(run)
    assert [(v.slot, v.point.name, v.reasons) for v in read_all(c, 2)] == [(bad, "SWEEP", Reason.FINGERPRINT)]
