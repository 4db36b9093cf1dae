"""The per-step host path on CUDA: counters, stats and error flags snapshotted into preallocated
pinned rows (published by a kernel, or where the device cannot publish one copy; nothing
allocated per step) and read one step late; the token-truth scatter in one launch that also
writes the truth lengths. Runs only where a GPU is present."""

from __future__ import annotations

import pytest
import torch

from kvcanary.config import CanaryConfig, Policy
from kvcanary.core.record import CHAIN, Reason, record_words
from kvcanary.errors import KVCanaryError
from kvcanary.runtime.batch import BatchError, ForwardBatch
from kvcanary.runtime.canary import Canary, PoolGeometry

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROWS, CTX = 5, 24


def _canary(device: str, snapshots: str = "published", **config) -> Canary:
    """A canary; ``snapshots="copied"``: as on a device that cannot publish into pinned memory."""
    cfg = CanaryConfig(**({"policy": Policy.LOG, "max_bs": 4, "max_tokens": 64, "sweep_interval": 0} | config))
    canary = Canary(cfg, PoolGeometry(num_slots=ROWS * CTX + 1, rows=ROWS, max_ctx=CTX, device=device))
    if snapshots == "copied":
        canary.reporter.publication, canary.route.publishing = None, False
    return canary


def _batch(device: str, gen: torch.Generator, tokens: torch.Tensor, prefix: int, extend: int,
           truth: bool = True) -> ForwardBatch:
    """Requests on rows 1..3, each writing positions prefix..prefix+extend-1 of its own run of slots."""
    rows = torch.tensor([1, 2, 3])
    table = (torch.arange(ROWS * CTX, dtype=torch.int32) + 1).view(ROWS, CTX)
    pos = torch.arange(prefix, prefix + extend).repeat(3)
    row_of = rows.repeat_interleave(extend)
    kw = {}
    if truth:
        n = prefix + extend
        kw = dict(truth_ids=tokens[1:4, :n].reshape(-1).contiguous(), truth_offsets=torch.arange(0, 3 * n + 1, n))
    b = dict(req_pool_indices=rows, prefix_lens=torch.full((3,), prefix), extend_lens=torch.full((3,), extend),
             req_to_token=table, input_ids=tokens[row_of, pos], positions=pos, out_cache_loc=table[row_of, pos].long(),
             **kw)
    return ForwardBatch(**{k: v.to(device) for k, v in b.items()})


def _tokens(gen: torch.Generator) -> torch.Tensor:
    return torch.randint(1, 50_000, (ROWS, CTX), generator=gen)


@pytest.mark.parametrize("snapshots", ["published", "copied"])
def test_snapshots_reuse_their_pinned_rows_and_match_a_synchronous_read(snapshots):
    gen = torch.Generator().manual_seed(3)
    tokens = _tokens(gen)
    canary = _canary("cuda", snapshots)
    copies = canary.reporter._copies
    rows_before = len(copies.rows)
    for step in range(12):
        with canary.forward(_batch("cuda", gen, tokens, step, 1)):
            pass
        assert canary.end_step(step).violations == []
    assert len(copies.rows) == rows_before  # nothing allocated per step
    if snapshots == "published":  # eager steps publish: no copy row taken, every row arrived in time
        assert len(copies.free) == rows_before and canary.reporter.publication.fallbacks == 0
    canary.flush(12)
    torch.cuda.synchronize()
    assert torch.equal(canary.reporter.latest_stats, canary.state.stats.cpu())
    assert canary.counters()["HEAD"]["launches"] == 12 and canary.counters()["HEAD"]["stamped"] == 36


def _run(canary: Canary, gen, tokens, steps: range) -> list:
    reports = []
    for step in steps:
        with canary.forward(_batch("cuda", gen, tokens, step, 1)):
            pass
        reports.append(canary.end_step(step))
    return reports


@pytest.mark.parametrize("snapshots", ["published", "copied"])
def test_a_violation_is_reported_one_step_late_and_only_then(snapshots):
    gen = torch.Generator().manual_seed(4)
    tokens = _tokens(gen)
    canary = _canary("cuda", snapshots)
    assert all(r.violations == [] for r in _run(canary, gen, tokens, range(4)))
    canary.flush(4)
    slot = 1 * CTX + 2 + 1  # row 1, position 2
    record_words(canary.state.records)[slot, CHAIN] ^= 1
    now, late = _run(canary, gen, tokens, range(4, 6))
    assert now.violations == []  # the step's rows are read at the next end_step
    assert late.violations and {v.step for v in late.violations} == {4}
    assert slot in {v.slot for v in late.violations if v.point.name == "HEAD"}


def test_a_device_flag_is_reported_one_step_late():
    gen = torch.Generator().manual_seed(8)
    tokens = _tokens(gen)
    canary = _canary("cuda")
    assert [r.device_flags for r in _run(canary, gen, tokens, range(2))] == [0, 0]
    canary.state.workspaces[0].sync[1] = 9  # a stale HEAD workspace: the kernel raises WORKSPACE
    flags = [r.device_flags for r in _run(canary, gen, tokens, range(2, 5))]
    assert flags[0] == 0 and flags[1] == 4 and canary.totals.device_errors >= 1


def test_truth_scatter_on_cuda_matches_the_cpu_path_and_writes_the_lengths():
    gen = torch.Generator().manual_seed(5)
    tokens = _tokens(gen)
    got, want = _canary("cuda"), _canary("cpu", fused=False)  # op by op: prepare_head scatters (as CUDA's does)
    for canary, dev in ((got, "cuda"), (want, "cpu")):
        canary.truth.copy_(torch.randint(-9, 9, (ROWS, CTX), generator=torch.Generator().manual_seed(6)))
        canary.truth_lens.fill_(-5)
        canary.prepare_head(_batch(dev, gen, tokens, 7, 3))
    assert torch.equal(got.truth.cpu(), want.truth)
    assert got.truth_lens.cpu().tolist() == want.truth_lens.tolist() == [10, 10, 10, -5]


def test_truth_scatter_on_cuda_refuses_a_strided_history_before_writing():
    gen = torch.Generator().manual_seed(7)
    b = _batch("cuda", gen, _tokens(gen), 2, 1)
    strided = torch.zeros(2 * b.truth_ids.numel(), dtype=torch.int64, device="cuda")[::2]
    bad = ForwardBatch(**{**{f: getattr(b, f) for f in b.__dataclass_fields__}, "truth_ids": strided})
    canary = _canary("cuda")
    before = canary.truth.clone()
    with pytest.raises(BatchError, match=r"ForwardBatch.truth_ids must be contiguous"):
        canary.prepare_head(bad)
    assert torch.equal(canary.truth, before)


def _captured(canary: Canary, batch: ForwardBatch, step: int) -> torch.cuda.CUDAGraph:
    """HEAD and TAIL of ``batch`` in one graph (run eagerly once first, as step ``step``, as an
    engine does)."""
    canary.prepare_head(batch)
    canary.launch_head(batch)
    canary.tail(batch)
    canary.end_step(step)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        canary.launch_head(batch)
        canary.tail(batch)
    return graph


def _replay(canary: Canary, graph, batch: ForwardBatch, steps: range) -> list:
    reports = []
    for step in steps:
        canary.prepare_head(batch)
        graph.replay()
        reports.append(canary.end_step(step))
    return reports


def test_replays_publish_their_counters_and_a_violation_arrives_one_step_late_without_a_copy():
    gen = torch.Generator().manual_seed(10)
    tokens = _tokens(gen)
    canary = _canary("cuda")
    assert canary.publishing
    for step in range(3):  # stamp positions 0..2 of rows 1..3
        with canary.forward(_batch("cuda", gen, tokens, step, 1)):
            pass
        canary.end_step(step)
    batch = _batch("cuda", gen, tokens, 3, 1)
    graph = _captured(canary, batch, 3)
    assert all(r.violations == [] for r in _replay(canary, graph, batch, range(4, 8)))
    copies = len(canary.reporter._copies.free)  # every copy row back: the eager step's was read
    slot = 2 * CTX + 1 + 1  # row 2, position 1
    record_words(canary.state.records)[slot, CHAIN] ^= 1
    now, late = _replay(canary, graph, batch, range(8, 10))
    assert now.violations == [] and late.violations and {v.step for v in late.violations} == {8}
    assert slot in {v.slot for v in late.violations if v.point.name == "HEAD"}
    assert canary.reporter.publication.fallbacks == 0
    assert len(canary.reporter._copies.free) == copies  # no copy was taken for a replayed step
    canary.flush(10)
    torch.cuda.synchronize()
    assert torch.equal(canary.reporter.latest_stats, canary.state.stats.cpu())


def test_replays_without_end_step_fall_back_once_and_miss_nothing():
    gen = torch.Generator().manual_seed(11)
    tokens = _tokens(gen)
    canary = _canary("cuda")
    for step in range(3):
        with canary.forward(_batch("cuda", gen, tokens, step, 1)):
            pass
        canary.end_step(step)
    batch = _batch("cuda", gen, tokens, 3, 1)
    graph = _captured(canary, batch, 3)
    for _ in range(20):  # the device runs ahead of what the host counted
        graph.replay()
    torch.cuda.synchronize()  # ... by all 20 (else a slow replay lets the host read each row in time)
    slot = 3 * CTX + 2 + 1  # row 3, position 2
    record_words(canary.state.records)[slot, CHAIN] ^= 1
    reports = _replay(canary, graph, batch, range(4, 7))
    assert canary.reporter.publication.fallbacks >= 1
    assert slot in {v.slot for r in reports for v in r.violations}


def _count_publication_launches(canary: Canary, monkeypatch) -> list:
    """The publication's own launches (``end_step``'s), counted from here on."""
    launches, launch = [], canary.reporter.publication.launch
    monkeypatch.setattr(canary.reporter.publication, "launch", lambda: (launches.append(1), launch())[1])
    return launches


@pytest.mark.parametrize("damaged", [False, True])
def test_an_eager_tail_publishes_its_steps_counters_and_end_step_launches_none(monkeypatch, damaged):
    gen = torch.Generator().manual_seed(12)
    tokens = _tokens(gen)
    canary = _canary("cuda")
    launches = _count_publication_launches(canary, monkeypatch)
    assert all(r.violations == [] for r in _run(canary, gen, tokens, range(4)))
    slot = 2 * CTX + 1 + 1  # row 2, position 1
    if damaged:
        record_words(canary.state.records)[slot, CHAIN] ^= 1
    now, late, after = _run(canary, gen, tokens, range(4, 7))
    assert now.violations == []
    if damaged:  # HEAD of step 4 and of every later step reads it
        assert {v.step for v in late.violations} == {4}
        assert {(v.point.name, v.reasons) for v in late.violations if v.slot == slot} == {
            ("HEAD", Reason.CHAIN), ("TAIL", Reason.CHAIN)}
    else:
        assert late.violations == [] and after.violations == []
    assert launches == [] and canary.reporter.publication.fallbacks == 0
    canary.flush(7)
    torch.cuda.synchronize()
    assert torch.equal(canary.reporter.latest_stats, canary.state.stats.cpu())


@pytest.mark.parametrize("damaged", [False, True])
def test_a_sweep_after_the_eager_tail_is_published_by_end_step_with_its_step(monkeypatch, damaged):
    """A launch between TAIL and ``end_step`` makes TAIL's publication stale: ``end_step`` publishes
    again, so the sweep's violation is read with its own step."""
    from kvcanary.runtime.sweep import SweepRun

    gen = torch.Generator().manual_seed(13)
    tokens = _tokens(gen)
    canary = _canary("cuda")
    launches = _count_publication_launches(canary, monkeypatch)
    _run(canary, gen, tokens, range(3))  # positions 0..2 of rows 1..3 stamped
    with canary.forward(_batch("cuda", gen, tokens, 3, 1)):
        pass
    slot = 1 * CTX + 0 + 1  # row 1, position 0
    if damaged:
        record_words(canary.state.records)[slot, CHAIN] ^= 1
    canary.sweep([SweepRun(torch.tensor([slot]), (int(tokens[1, 0]),), 0)])
    assert launches == []
    now = canary.end_step(3)
    assert launches == [1]  # the sweep came after TAIL's publication
    with canary.forward(_batch("cuda", gen, tokens, 4, 1)):
        pass
    late = canary.end_step(4)
    assert now.violations == []
    if damaged:
        got = {(v.step, v.point.name, v.slot, v.reasons) for v in late.violations}
        assert got == {(3, "SWEEP", slot, Reason.CHAIN)}
    else:
        assert late.violations == []
    assert launches == [1] and canary.reporter.publication.fallbacks == 0


def _count_scatter_launches(monkeypatch) -> list:
    """The canary's own truth-scatter launches (not a HEAD's), counted from here on."""
    import kvcanary.runtime.forward as forward_module

    launches, scatter = [], forward_module.scatter_validated
    monkeypatch.setattr(forward_module, "scatter_validated", lambda *a, **k: (launches.append(1), scatter(*a, **k))[1])
    return launches


@pytest.mark.parametrize("damaged", [False, True])
def test_an_eager_head_scatters_its_truth_in_its_own_launch(monkeypatch, damaged):
    """``forward`` (``prepare_head(eager=True)``): HEAD's launch writes the histories and lengths
    the scatter would (the CPU path's table), launches no scatter of its own, and a history that
    differs from what a slot holds is caught at HEAD and TAIL of its step."""
    gen = torch.Generator().manual_seed(14)
    tokens = _tokens(gen)
    got, want = _canary("cuda"), _canary("cpu", fused=False)
    launches = _count_scatter_launches(monkeypatch)
    reports = []
    for step in range(5):
        told = tokens.clone()
        if damaged and step == 4:
            told[2, 1] += 1  # row 2's history at position 1 no longer matches its stamped slot
        for canary, dev in ((got, "cuda"), (want, "cpu")):
            with canary.forward(_batch(dev, gen, told, step, 1)):
                pass
        reports.append(got.end_step(step))
        want.end_step(step)
    reports.append(got.flush(5))
    assert launches == []
    torch.cuda.synchronize()
    assert torch.equal(got.truth.cpu(), want.truth) and torch.equal(got.truth_lens.cpu(), want.truth_lens)
    found = {(v.step, v.point.name, v.slot, v.reasons) for r in reports for v in r.violations}
    slot = 2 * CTX + 1 + 1  # row 2, position 1
    assert found == ({(4, "HEAD", slot, Reason.VERIFY_TOKEN), (4, "TAIL", slot, Reason.VERIFY_TOKEN)} if damaged
                     else set())


def test_prepare_head_eager_without_its_launch_head_raises_at_end_step_with_the_table_right(monkeypatch):
    gen = torch.Generator().manual_seed(15)
    tokens = _tokens(gen)
    canary, want = _canary("cuda"), _canary("cpu", fused=False)
    launches = _count_scatter_launches(monkeypatch)
    b = _batch("cuda", gen, tokens, 3, 2)
    canary.prepare_head(b, eager=True)
    assert launches == []  # left to HEAD
    with pytest.raises(KVCanaryError, match=r"prepare_head\(batch, eager=True\) .* no launch_head of that batch"):
        canary.end_step(0)
    assert launches == [1]  # scattered when the promise broke
    want.prepare_head(_batch("cpu", gen, tokens, 3, 2))
    torch.cuda.synchronize()
    assert torch.equal(canary.truth.cpu(), want.truth) and torch.equal(canary.truth_lens.cpu(), want.truth_lens)
    with pytest.raises(KVCanaryError, match="prepare_head eager must be True or False, got 1"):
        canary.prepare_head(b, eager=1)
