"""Two tensor-parallel ranks, one process each, gloo on the CPU: the sharded model equals one
unsharded engine bit for bit; a clean run reports nothing on any rank; a page-table fault on
rank 1 only is reported on both ranks in the step it happens, as a ``rank_divergence`` naming
rank 1 with its reasons (log: read one step late); raise stops both ranks in the same step, the
one after the fault's (its table is read one step late); recompute retracts the same
requests on both ranks and every request delivers the clean run's tokens; ranks that disagree
on a sampled token (no slot check can see it) are caught by the chain digest.

All runs share one pair of processes (``spawn_ranks`` runs the jobs in order)."""

from __future__ import annotations

import pytest
import torch

from kvcanary.config import CanaryConfig, Policy
from kvcanary.engine.config import ModelConfig, SamplerKind
from kvcanary.engine.engine import Engine
from kvcanary.engine.workload import WorkloadConfig, builtin_workload, engine_config_for
from kvcanary.faults.page_table_repoint import PageTableRepoint
from kvcanary.faults.sliding_window_lut import SlidingWindowLut
from kvcanary.runs.report import RunReport, merge_ranks
from kvcanary.runs.setup import RunSetup
from kvcanary.runs.single import run_once
from kvcanary.runs.tp import RankJob, spawn_ranks

from ._ranks import LOGITS_ENGINE, LOGITS_MODEL, SamplerDivergence, main, step_logits

WARMUP = 10  # the page-table fault acts at this step


TINY = ModelConfig()
HYBRID = ModelConfig(num_layers=4, sliding_window=8, window_layers=(0, 2))  # two layers keep a window pool


def setup(policy: Policy = Policy.LOG, model: ModelConfig = TINY) -> RunSetup:
    workload = builtin_workload(WorkloadConfig(num_requests=24, max_new_tokens=8))
    return RunSetup(model, engine_config_for(workload, sampler=SamplerKind.GREEDY),
                    CanaryConfig(policy=policy, sweep_interval=4), workload)


def repoint() -> tuple[PageTableRepoint, ...]:
    return (PageTableRepoint(seed=0, warmup_steps=WARMUP),)


JOBS = [
    RankJob("clean", setup(), keep_outputs=True),
    RankJob("fault_log", setup(), repoint(), fault_rank=1),
    RankJob("fault_raise", setup(Policy.RAISE), repoint(), fault_rank=1),
    RankJob("fault_recompute", setup(Policy.RECOMPUTE), repoint(), fault_rank=1, keep_outputs=True),
    RankJob("window_recompute", setup(Policy.RECOMPUTE, HYBRID), (SlidingWindowLut(
        seed=0, warmup_steps=WARMUP),), fault_rank=1, keep_outputs=True),
    RankJob("digest_recompute", setup(Policy.RECOMPUTE), (SamplerDivergence(seed=0, warmup_steps=WARMUP),),
            fault_rank=1, keep_outputs=True),
]


@pytest.fixture(scope="module")
def reports():
    return spawn_ranks(2, JOBS, target=main)


@pytest.fixture(scope="module")
def runs(reports):
    """Each job's per-rank reports as their JSON."""
    return {name: [r.to_json() if isinstance(r, RunReport) else r for r in ranks] for name, ranks in reports.items()}


@pytest.fixture(scope="module")
def single_rank_outputs():
    out = run_once(setup())
    assert out.violations == []
    return [out.engine.output_ids(i) for i in out.counts.request_ids]


def test_sharded_logits_equal_one_engine_bit_for_bit(runs):
    want = step_logits(Engine(LOGITS_MODEL, LOGITS_ENGINE))
    for rank in runs["logits"]:
        assert rank["kv_heads"] == LOGITS_MODEL.num_kv_heads // 2  # each rank's pool holds its half of the heads
        got = rank["logits"]
        assert len(got) == len(want) and [g.keys() for g in got] == [w.keys() for w in want]
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            for rid in w:
                assert torch.equal(g[rid], w[rid]), f"rank {rank['rank']} step {step} request {rid}"


def test_clean_run_reports_nothing_on_any_rank(runs, reports, single_rank_outputs):
    ranks = runs["clean"]
    for r in ranks:
        assert r["violations"] == 0 and r["rank_divergences"] == [] and r["stopped"] is None
        assert r["protected_slots"] > 0 and r["verified_slots"] > 0 and r["engine"]["num_loaded_slots"] > 0
        assert r["outputs"] == single_rank_outputs  # TP delivers what one engine does
    report = merge_ranks(reports["clean"]).to_json()
    assert report["violations"] == 0 and len(report["ranks"]) == 2
    assert report["protected_slots"] == sum(r["protected_slots"] for r in ranks)


def first_step_with(ranks: list[dict]) -> list[int]:
    return [min(d["step"] for d in r["rank_divergences"]) for r in ranks]


def test_fault_on_rank_1_is_reported_on_both_ranks_in_its_step(runs):
    rank0, rank1 = runs["fault_log"]
    (inj,) = rank1["injections"]
    assert rank0["injections"] == [] and inj["fault"] == "page_table_repoint" and inj["step"] == WARMUP
    # rank 1's own checks: chain (and position) at HEAD of the injection step
    first = rank1["first_violations"][0]
    assert first["step"] == WARMUP and first["launch_point"] == "HEAD" and "chain" in first["reasons"]
    assert PageTableRepoint.expected.reasons.name.lower() in first["reasons"]
    # rank 0 saw nothing itself...
    assert rank0["violations_decoded"] == 0 and rank0["by_launch_point"] == {"HEAD": 0, "TAIL": 0, "SWEEP": 0}
    # ...and both ranks report the divergence, naming rank 1 and its reasons at HEAD, in the same step
    assert first_step_with([rank0, rank1]) == [WARMUP, WARMUP]
    for r in (rank0, rank1):
        d = r["rank_divergences"][0]
        assert d["cause"] == "violations" and d["ranks"] == [1] and d["observer"] == r["rank"]
        odd = d["per_rank"][1]
        assert odd["launch_points"] == ["HEAD"] and {"chain", "position"} <= set(odd["reasons"])
        assert d["per_rank"][0]["violation_rows"] == 0
        assert r["by_reason"]["rank_divergence"] == len(r["rank_divergences"])
    strip = lambda ds: [{k: v for k, v in d.items() if k != "observer"} for d in ds]
    assert strip(rank0["rank_divergences"]) == strip(rank1["rank_divergences"])
    assert all(d["cause"] == "violations" for d in rank0["rank_divergences"])  # the digests agreed
    assert rank0["steps"] == rank1["steps"] and rank0["stopped"] is None


def test_raise_stops_both_ranks_in_the_same_step_one_after_the_fault(runs):
    ranks = runs["fault_raise"]
    for r in ranks:
        assert r["stopped"] and f"step {WARMUP}, rank {r['rank']} of 2" in r["stopped"]
        assert "cause=violations ranks=1" in r["stopped"]
        assert r["steps"] == WARMUP + 1  # the fault's table is read at the end of the next step, which stops
    assert ranks[1]["violations_decoded"] > 0 and ranks[0]["violations_decoded"] == 0


def test_recompute_retracts_the_same_requests_on_both_ranks(runs, single_rank_outputs):
    rank0, rank1 = runs["fault_recompute"]
    assert rank0["recoveries"] and rank0["recoveries"] == rank1["recoveries"]
    assert rank0["recoveries"][0]["step"] == WARMUP and rank0["recoveries"][0]["since_step"] == WARMUP
    assert rank0["engine"] == rank1["engine"] and rank0["engine"]["num_recomputes"] > 0
    assert rank0["engine"]["num_quarantined_slots"] > 0
    for r in (rank0, rank1):
        assert r["stopped"] is None and r["outputs"] == single_rank_outputs


def test_a_window_pool_fault_on_rank_1_is_recomputed_on_both_ranks(runs):
    """Each rank has a second canary for its sliding-window pool; the agreement counts its rows too."""
    rank0, rank1 = runs["window_recompute"]
    (inj,) = rank1["injections"]
    assert inj["fault"] == "sliding_window_lut" and rank0["violations_decoded"] == 0
    assert rank1["window_pool"]["violations"] > 0 and rank0["window_pool"]["violations"] == 0
    for r in (rank0, rank1):
        assert r["window_pool"]["protected_slots"] > 0
        d = r["rank_divergences"][0]
        assert d["step"] == inj["step"] and d["ranks"] == [1] and d["per_rank"][1]["launch_points"] == ["HEAD"]
    assert rank0["recoveries"] and rank0["recoveries"] == rank1["recoveries"]
    clean = run_once(setup(model=HYBRID))
    assert clean.violations == []
    want = [clean.engine.output_ids(i) for i in clean.counts.request_ids]
    assert rank0["outputs"] == rank1["outputs"] == want


def test_ranks_that_disagree_on_a_token_are_caught_by_the_chain_digest(runs, single_rank_outputs):
    rank0, rank1 = runs["digest_recompute"]
    (inj,) = rank1["injections"]
    for r in (rank0, rank1):
        assert r["violations_decoded"] == 0  # no slot check on either rank sees it
        (d,) = r["rank_divergences"]
        assert d["cause"] == "chain_digest" and d["ranks"] == [1] and d["step"] == inj["step"] + 1
        assert d["per_rank"][0]["digest"] != d["per_rank"][1]["digest"]
        assert r["outputs"] == single_rank_outputs  # every request of the step was recomputed on both ranks
    assert rank0["recoveries"] == rank1["recoveries"] and rank0["recoveries"][0]["since_step"] == inj["step"]

