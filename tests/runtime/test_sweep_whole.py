"""A sweep whose runs fit its budget whole (``Sweeper._sweep_whole``) takes every entry of its runs,
in run order from the first, without cutting a window out of their joined arrays. On CUDA, with
the sweep's graphs, it stages each run's kept entries into the graphs' pinned rows in one copy
(``SweepGraphs.load_blocks``) and replays the verify alone where the runs are the same arrays; on
the CPU the compiled verify reads the runs' joined arrays. Both must load and report exactly what
a canary without them does (CUDA: no warm-up, each step launched; CPU: the ops one by one, through
the windowed path): the plan's columns, a damaged record, a run that claims another run's slot
with another token, each at SWEEP with the slot and the position the run gave, and the held slots."""

from __future__ import annotations

import pytest
import torch

from kvcanary.core.record import FINGERPRINT, Reason, record_words
from kvcanary.runtime.sweep import SweepRun

from ._helpers import prefilled, read_all

NUM_SLOTS, CTX, KEEP = 600, 160, 3

PATHS = [pytest.param("cpu", id="cpu"),
         pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
             not torch.cuda.is_available(), reason="needs CUDA")])]


def _pair(seed: int, device: str):
    """(the canary that sweeps whole, the one that does not), prefilled alike."""
    if device == "cuda":
        whole, slots, tokens = prefilled(seed, device, NUM_SLOTS, CTX, 60, 512, plan_capacity=1024)
        other, slots2, _ = prefilled(seed, device, NUM_SLOTS, CTX, 60, 512, plan_capacity=1024, warmup=False)
        assert whole.sweeper.graphs is not None and other.sweeper.graphs is None
    else:
        whole, slots, tokens = prefilled(seed, device, NUM_SLOTS, CTX, 60, 512)
        other, slots2, _ = prefilled(seed, device, NUM_SLOTS, CTX, 60, 512, fused=False)
        assert whole.cpu is not None and other.cpu is None
    assert slots2 == slots
    return whole, other, slots, tokens


def _runs(slots, tokens) -> list[SweepRun]:
    return [SweepRun(torch.tensor(s[KEEP:], dtype=torch.int64), tuple(t[KEEP:]), KEEP, s[KEEP - 1])
            for s, t in zip(slots, tokens, strict=True)]


def _found(c, step: int) -> list:
    return [(v.slot, v.point.name, v.reasons, v.owners) for v in read_all(c, step)]


@pytest.mark.parametrize("device", PATHS)
@pytest.mark.parametrize("seed", [11, 12])
def test_a_sweep_that_fits_whole_loads_and_reports_what_the_windowed_sweep_does(seed, device):
    whole, other, slots, tokens = _pair(seed, device)
    calls = []
    graphs = whole.sweeper.graphs
    if graphs is not None:
        for name in ("load", "load_blocks", "again"):
            f = getattr(graphs, name)
            setattr(graphs, name, lambda *a, f=f, name=name: calls.append(name) or f(*a))
    runs = _runs(slots, tokens)
    runs.insert(1, SweepRun(torch.zeros(0, dtype=torch.int64), (), 0))  # empty: skipped
    n = sum(len(s) - KEEP for s in slots)
    every = [s for r in runs for s in r.slots.tolist()]
    for c in (whole, other):
        c.sweeper.cursor = 0
        assert c.sweep(runs, hold=True) == n
        assert c.held.tolist() == every
    if device == "cuda":
        p, q = whole.sweep_plan, other.sweep_plan
        cols = lambda plan: [t[:n].tolist() for t in (plan.slot, plan.pred, plan.position, plan.token, plan.entry,
                                                      plan.row)]
        assert int(p.count[0]) == int(q.count[0]) == n and cols(p) == cols(q)
        assert calls == ["load_blocks"]
        # the held slots as the next HEAD reads them: the counted words, the count then the slots
        words = whole.holds.counted
        assert int(words[0]) == n and words[1: 1 + n].tolist() == every
    assert _found(whole, 1) == _found(other, 1) == []

    bad = slots[0][KEEP + 4]
    for c in (whole, other):
        record_words(c.state.records)[bad, FINGERPRINT] ^= 1 << 11  # its own word only: no successor's chain moves
        assert c.sweep(runs) == n  # the same arrays: on CUDA the plan holds them
    assert calls[-1:] == (["again"] if device == "cuda" else [])
    want = [(bad, "SWEEP", Reason.FINGERPRINT, (("cache", KEEP + 4),))]
    assert _found(whole, 3) == _found(other, 3) == want
    for c in (whole, other):
        record_words(c.state.records)[bad, FINGERPRINT] ^= 1 << 11  # repaired

    k = KEEP + 7  # a stale run: slot k of the second row, claimed at its position with another token
    target, pred = slots[1][k], slots[1][k - 1]
    stale = SweepRun(torch.tensor([target], dtype=torch.int64), ((tokens[1][k] + 1) % 30_000,), k, pred)
    for c in (whole, other):
        assert c.sweep([*runs, stale]) == n + 1
    if device == "cuda":
        assert calls[-1] == "load_blocks"
    found = _found(whole, 5)
    assert found == _found(other, 5)
    assert found == [(target, "SWEEP", Reason.VERIFY_TOKEN, (("cache", k),))]
    for c in (whole, other):
        assert c.sweep(runs) == n
    assert _found(whole, 7) == _found(other, 7) == []


@pytest.mark.parametrize("device", PATHS)
def test_a_sweep_over_more_than_its_budget_still_windows_the_runs(device):
    """The whole sweep stands aside where the runs do not fit: a budget of 5 entries verifies 5,
    continuing where the last stopped, as before."""
    whole, other, slots, tokens = _pair(13, device)
    runs = _runs(slots, tokens)
    budget = 5 * whole.entry_bytes()
    for c in (whole, other):
        c.sweeper.cursor = 0
        assert [c.sweep(runs, budget) for _ in range(3)] == [5, 5, 5]
        assert c.sweeper.cursor == 15
    assert _found(whole, 1) == _found(other, 1) == []
