"""Two tensor-parallel ranks on two CUDA devices with NCCL: the agreement's signal is read one
step late from pinned memory, so a page-table fault on rank 1 reaches both ranks within two steps.
Runs only where two GPUs are present (pytest -m gpu)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcanary.config import Policy
from kvcanary.runs.single import run_once
from kvcanary.runs.tp import RankJob, spawn_ranks

from .test_tp import WARMUP, repoint, setup

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]


def cuda_setup(policy: Policy = Policy.LOG):
    s = setup(policy)
    return dataclasses.replace(s, engine=dataclasses.replace(s.engine, device="cuda"))


def test_clean_and_fault_runs_on_two_gpus():
    jobs = [RankJob("clean", cuda_setup(), keep_outputs=True),
            RankJob("fault_log", cuda_setup(), repoint(), fault_rank=1),
            RankJob("fault_raise", cuda_setup(Policy.RAISE), repoint(), fault_rank=1),
            RankJob("fault_recompute", cuda_setup(Policy.RECOMPUTE), repoint(), fault_rank=1, keep_outputs=True)]
    runs = {name: [r.to_json() for r in ranks] for name, ranks in spawn_ranks(2, jobs, threads=2).items()}
    single = run_once(cuda_setup())
    want = [single.engine.output_ids(i) for i in single.counts.request_ids]
    for r in runs["clean"]:
        assert r["violations"] == 0 and r["rank_divergences"] == [] and r["outputs"] == want
    rank0, rank1 = runs["fault_log"]
    assert rank1["injections"][0]["step"] == WARMUP and rank0["violations_decoded"] == 0
    for r in (rank0, rank1):
        d = r["rank_divergences"][0]
        assert d["ranks"] == [1] and "HEAD" in d["per_rank"][1]["launch_points"]
        assert d["step"] - WARMUP <= 1  # the signal of step s is read at the end of step s + 1
    for r in runs["fault_raise"]:
        assert r["stopped"] and r["steps"] == runs["fault_raise"][0]["steps"] <= WARMUP + 1
    rank0, rank1 = runs["fault_recompute"]
    assert rank0["recoveries"] and rank0["recoveries"] == rank1["recoveries"]
    assert rank0["outputs"] == rank1["outputs"] == want
