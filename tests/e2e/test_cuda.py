"""The canary inside the reference engine on CUDA: Triton kernels, pinned snapshots read one step
late. Runs only where a GPU is present (pytest -m gpu)."""

from __future__ import annotations

import pytest
import torch

from kvcanary.config import CanaryConfig
from kvcanary.engine.config import ModelConfig
from kvcanary.engine.workload import WorkloadConfig, builtin_workload, engine_config_for
from kvcanary.runs.campaign import run_campaign
from kvcanary.runs.setup import RunSetup
from kvcanary.runs.single import run_once

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _setup(**canary) -> RunSetup:
    workload = builtin_workload(WorkloadConfig(num_requests=48, seed=0))
    config = CanaryConfig(**({"sweep_interval": 4} | canary))
    return RunSetup(ModelConfig(seed=0), engine_config_for(workload, device="cuda"), config, workload)


def test_clean_run_on_cuda_reports_nothing_and_checks_everything():
    outcome = run_once(_setup())
    assert not outcome.violations and outcome.error is None
    counters = outcome.hooks.canary.counters()
    assert counters["HEAD"]["checked"] > 0 and counters["SWEEP"]["launches"] > 0
    assert outcome.engine.stats.num_loaded_slots > 0  # load-back verification ran on the device too


def test_every_fault_is_detected_on_cuda():
    result = run_campaign(_setup())
    assert result.clean_violations == 0
    missed = [(v.fault, v.first_detection, v.expected) for v in result.verdicts if v.injected and not v.detected]
    assert not missed, missed
    assert all(v.false_positives == 0 for v in result.verdicts), [v.to_json() for v in result.verdicts]
