"""A CUDA canary's sweep (``Canary.sweep``): the entries land in the sweep plan's columns exactly,
whatever an earlier, longer sweep left behind them; a clean sweep reports nothing and a record
damaged since its stamp is reported by the sweep, at SWEEP, naming the slot. Held slots
(``Canary.hold``) reach the HEAD after each hold, small or large. A warmed-up canary loads and
verifies the plan by replaying a captured graph (``runtime.sweep_graphs``): the same columns,
counts and violations as a canary that launches each step, at every size class boundary. Runs
only where a GPU is present."""

from __future__ import annotations

import time

import pytest
import torch

from kvcanary.core.record import FINGERPRINT, Reason, record_words
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.canary import Canary
from kvcanary.runtime.sweep import SweepRun
from kvcanary.runtime.sweep_graphs import class_sizes

from ._helpers import prefilled, read_all

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NUM_SLOTS, ROWS, CTX = 400, 4, 96


def _filled(seed: int) -> tuple[Canary, list[list[int]], list[list[int]]]:
    return prefilled(seed, "cuda", NUM_SLOTS, CTX, 20, 512)


def _runs(slots, tokens, keep: int) -> list[SweepRun]:
    """The rows' slots from position ``keep`` on, as runs (their predecessor: the slot before)."""
    return [SweepRun(torch.tensor(s[keep:], dtype=torch.int64), tuple(t[keep:]), keep, s[keep - 1] if keep else -1)
            for s, t in zip(slots, tokens, strict=True)]


@pytest.mark.parametrize("seed", [3, 4])
def test_a_sweep_lands_its_entries_exactly_and_reports_only_damage(seed):
    c, slots, tokens = _filled(seed)
    assert c.sweep(_runs(slots, tokens, 0)) == sum(map(len, slots))  # a long sweep first ...
    keep = 7
    n = c.sweep(_runs(slots, tokens, keep))  # ... then a shorter one over what it left
    p = c.sweep_plan
    want = [(s, s_[keep + i - 1], keep + i, t) for s_, t_ in zip(slots, tokens, strict=True)
            for i, (s, t) in enumerate(zip(s_[keep:], t_[keep:], strict=True))]
    assert n == len(want) and int(p.count[0]) == n
    got = list(zip(p.slot[:n].tolist(), p.pred[:n].tolist(), p.position[:n].tolist(), p.token[:n].tolist(),
                   strict=True))
    assert got == want
    assert p.entry[:n].tolist() == p.slot[:n].tolist() and not p.row[:n].any()
    assert read_all(c, 1) == []
    bad = slots[1][keep + 3]
    record_words(c.state.records)[bad, FINGERPRINT] ^= 1 << 17  # its own word only: no successor's chain moves
    c.sweep(_runs(slots, tokens, keep))
    found = read_all(c, 3)
    assert [(v.slot, v.point.name) for v in found] == [(bad, "SWEEP")]
    assert found[0].reasons == Reason.FINGERPRINT


def _write_into(c: Canary, slots: list[int], token: int) -> list:
    """A forward of one request (row 1, nothing cached) writing ``slots``; its violations."""
    i64 = lambda v: torch.tensor(v, dtype=torch.int64, device="cuda")
    table = torch.zeros(ROWS, CTX, dtype=torch.int32)
    table[1, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
    b = ForwardBatch(i64([1]), i64([0]), i64([len(slots)]), table.cuda(), i64([token] * len(slots)),
                     i64(list(range(len(slots)))), i64(slots))
    c.prepare_head(b)
    c.launch_head(b)
    return read_all(c, 10)


@pytest.mark.parametrize("busy", [False, True], ids=["idle stream", "busy stream"])
def test_held_slots_reach_the_head_that_follows_each_hold_whatever_its_size(busy):
    c, slots, _ = _filled(5)
    free = sorted(set(range(1, NUM_SLOTS)) - set(sum(slots, [])))
    held = torch.tensor(slots[0][:5], dtype=torch.int64)  # a small hold first, then a large one
    c.hold(held)
    assert _write_into(c, free[:3], 7) == []  # the clean twin: no write into a held slot
    big = torch.tensor(sum(slots, []), dtype=torch.int64)
    for hold, target in ((held, int(held[2])), (big, int(big[-4]))):
        torch.cuda.synchronize()
        if busy:  # queued device work: the hold goes through pinned memory and must not wait for it
            torch.cuda._sleep(200_000_000)
            t = time.perf_counter()
        c.hold(hold)
        if busy:
            assert time.perf_counter() - t < 0.05, "hold waited for the queued device work"
        found = _write_into(c, [free[3], target], 9)
        conflicts = [v for v in found if v.reasons & Reason.READ_CONFLICT]
        assert [(v.slot, v.point.name) for v in conflicts] == [(target, "HEAD")]


def test_a_head_replayed_from_a_graph_checks_the_slots_held_in_its_own_step():
    """A captured HEAD reads the held slots counted on the device at each replay (``ops.conflicts``'
    held words): a write into a slot held in the replay's step is a READ_CONFLICT at HEAD naming the
    cache (row 0), as at an eager HEAD (the test above). The replay consumes the hold: a second
    replay in the step reports nothing. A hold pending while the graph is captured stays pending
    (the capture ran nothing) and, like every hold no HEAD read, is dropped at the step's end, so
    the next step's replay reports nothing. (No model writes the targets' K/V here: each forward's
    TAIL reports them as missed writes.)"""
    c, slots, tokens = _filled(6)
    free = sorted(set(range(1, NUM_SLOTS)) - set(sum(slots, [])))
    i64 = lambda v: torch.tensor(v, dtype=torch.int64, device="cuda")  # noqa: E731
    table = torch.zeros(ROWS, CTX, dtype=torch.int32, device="cuda")
    table[1, :2] = torch.tensor(free[:2], dtype=torch.int32)
    b = ForwardBatch(i64([1]), i64([0]), i64([2]), table, i64([9, 9]), i64([0, 1]), i64(free[:2]))
    c.prepare_head(b)  # run eagerly once first, as an engine does, then captured
    c.launch_head(b)
    c.tail(b)
    assert {v.point.name for v in read_all(c, 1)} <= {"TAIL"}
    torch.cuda.synchronize()
    c.hold(torch.tensor(slots[1][:4], dtype=torch.int64))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c.launch_head(b)
        c.tail(b)
    assert c.held is not None and int(c.holds.counted[0]) == 4  # pending: the capture consumed nothing

    def conflicts(step: int) -> list:
        return [(v.slot, v.point.name, v.expected_value) for v in read_all(c, step)
                if v.reasons & Reason.READ_CONFLICT]

    assert conflicts(2) == [] and int(c.holds.counted[0]) == 0
    target = slots[0][2]
    b.out_cache_loc.copy_(i64([free[2], target]))  # the graph's own buffers, as a replay reads them
    table[1, :2] = torch.tensor([free[2], target], dtype=torch.int32)

    c.hold(torch.tensor(slots[0], dtype=torch.int64))
    c.prepare_head(b)
    graph.replay()
    assert int(c.holds.counted[0]) == 0  # consumed by the replayed HEAD
    c.prepare_head(b)
    graph.replay()  # a second forward in the step: the hold is read
    assert conflicts(4) == [(target, "HEAD", 0)]
    c.hold(torch.tensor(slots[0], dtype=torch.int64))
    assert conflicts(6) == [] and int(c.holds.counted[0]) == 0  # a step without a forward: the hold is dropped
    c.prepare_head(b)
    graph.replay()
    assert conflicts(8) == []


def _columns(c: Canary, n: int) -> list:
    p = c.sweep_plan
    return [int(p.count[0])] + [t[:n].tolist() for t in (p.slot, p.pred, p.position, p.token, p.entry, p.row)]


@pytest.mark.parametrize("seed", [8, 9])
def test_a_replayed_sweep_loads_and_reports_what_launched_steps_do_at_every_class_boundary(seed):
    """Plan capacity 300: classes of 256 and 300 entries. Budgets of 1, 255, 256, 257 entries and
    the whole cache, each swept twice (the second time the plan holds the window: a replay of the
    same class), beside a canary built without warm-up (each step launched); then a record
    damaged in the window is reported by both, at SWEEP, naming the slot."""
    graphed, slots, tokens = prefilled(seed, "cuda", 600, 160, 100, 512, plan_capacity=300)
    launched, slots2, _ = prefilled(seed, "cuda", 600, 160, 100, 512, plan_capacity=300, warmup=False)
    assert slots2 == slots and launched.sweeper.graphs is None
    graphs = graphed.sweeper.graphs
    assert graphs is not None and graphs.sizes == class_sizes(300) == [256, 300]
    replays = []
    load, again = graphs.load, graphs.again
    graphs.load = lambda cols, n: replays.append(("load", n)) or load(cols, n)
    graphs.again = lambda: replays.append(("again",)) or again()
    runs = _runs(slots, tokens, 0)
    total = sum(map(len, slots))
    assert total > 300  # the last budget fills the plan
    for entries in (1, 255, 256, 257, total):
        budget = entries * graphed.entry_bytes()
        for c in (graphed, launched):  # the same cursor on both: each sweep continues where the last stopped
            c.sweeper.cursor = 0
        replays.clear()
        n = graphed.sweep(runs, budget)
        assert n == launched.sweep(runs, budget) == min(entries, 300)
        assert _columns(graphed, n) == _columns(launched, n)
        assert replays == [("load", n)]
        for c in (graphed, launched):
            c.sweeper.cursor = 0
        assert graphed.sweep(runs, budget) == launched.sweep(runs, budget) == n
        assert replays == [("load", n), ("again",)]  # the same window of the same entries: the plan holds it
        assert read_all(graphed, 1) == read_all(launched, 1) == []
    bad = slots[0][5]  # within the first 256 entries of the runs
    for c in (graphed, launched):
        record_words(c.state.records)[bad, FINGERPRINT] ^= 1 << 21
        c.sweeper.cursor = 0
        c.sweep(runs, 256 * c.entry_bytes())
    found = [[(v.slot, v.point.name, v.reasons) for v in read_all(c, 2)] for c in (graphed, launched)]
    assert found[0] == found[1] == [(bad, "SWEEP", Reason.FINGERPRINT)]


def test_a_replayed_sweep_that_holds_its_runs_holds_the_slots_its_graph_widened_and_keeps_them_past_a_reload():
    """``sweep(runs, hold=True)`` over every entry, from the first: the held slots are the ones the
    replay widened, copied with their count into the canary's held words on the device, every slot
    in order; a landed copy's check before the next HEAD replays the graph again with other
    entries, and leaves the held words as they were. A write into one of them is then a
    READ_CONFLICT at HEAD; into a free slot, nothing."""
    c, slots, tokens = _filled(10)
    graphs = c.sweeper.graphs
    runs = _runs(slots, tokens, 2)
    every = [s for r in runs for s in r.slots.tolist()]
    words = c.holds.counted
    c.sweep(runs, hold=True)
    assert c.held.data_ptr() == words[1:].data_ptr() and c.held.tolist() == every
    assert int(words[0]) == len(every)
    c.verify_landed(torch.tensor(slots[1][:6]))  # replays the graph with other entries
    assert c.held.tolist() == every and int(words[0]) == len(every)
    assert int(graphs.held[0]) == 6 and graphs.held[1:7].tolist() == slots[1][:6]
    free = sorted(set(range(1, NUM_SLOTS)) - set(sum(slots, [])))
    assert _write_into(c, free[:2], 3) == []
    c.sweep(runs, hold=True)  # the plan does not hold the runs' window since the landed check: loaded again
    assert c.held.tolist() == every and int(words[0]) == len(every)
    c.sweep(runs, hold=True)  # the window the plan holds: replayed again, held again
    assert c.held.tolist() == every and int(words[0]) == len(every)
    target = every[len(every) // 2]
    found = _write_into(c, [free[2], target], 4)
    assert [(v.slot, v.point.name) for v in found if v.reasons & Reason.READ_CONFLICT] == [(target, "HEAD")]
