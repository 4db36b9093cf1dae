"""The options the commands share, as ``Annotated`` types (``opt.Seed``, ``opt.Model``, ...); each
command takes its defaults from the frozen options of ``kvcanary.runs.setup``."""

from __future__ import annotations

from typing import Annotated

import torch
import typer

from kvcanary.config import Policy
from kvcanary.ops.fingerprint import FingerprintMode
from kvcanary.runs.setup import CanaryOptions, DeviceName, ModelPreset


def _fingerprint_mode(value: FingerprintMode | str) -> FingerprintMode:
    if isinstance(value, FingerprintMode):
        return value
    try:
        return FingerprintMode[value.upper()]
    except KeyError:
        raise typer.BadParameter(f"{value!r} is not one of none, partial, all") from None


MODE_NAMES = {m: m.name.lower() for m in FingerprintMode}  # how --real-kv spells each mode (and its default)

Requests = Annotated[int, typer.Option("--requests", min=1, help="Requests of the built-in workload.")]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", min=2, help="Tokens each request generates.")]
Seed = Annotated[int, typer.Option("--seed", min=0, help="Seed of the workload, the model weights and the faults.")]
Model = Annotated[ModelPreset, typer.Option("--model", help="tiny: hidden 64, 2 layers; small: hidden 256, 4 layers; "
                                        "hybrid-swa: tiny with 4 layers, 2 of them over a sliding window of 8.")]
Device = Annotated[DeviceName, typer.Option("--device", help="Where the engine and the canary run.")]
PolicyOption = Annotated[Policy, typer.Option("--policy", help="off: no checks; log: report and keep serving; raise: "
                                            "stop at the first violation; recompute: quarantine the slots and "
                                            "re-prefill the requests.")]
RealKv = Annotated[FingerprintMode, typer.Option("--real-kv", parser=_fingerprint_mode, metavar="[none|partial|all]",
                                                 help="Fingerprint of the real K/V bytes: none, the first 16 bytes "
                                                 "of each row, or all of it.")]
SweepInterval = Annotated[int, typer.Option("--sweep-interval", min=0, help="Steps between sweeps of idle "
                                            "prefix-cache slots (0 = never).")]
SweepBudget = Annotated[int, typer.Option("--sweep-budget", min=1, help="Bytes one sweep may read.")]
Threads = Annotated[int | None, typer.Option("--threads", min=1, help="torch intra-op threads (default: 1 for "
                                             "tiny and hybrid-swa, whose small matmuls lose to thread barriers; 2 for "
                                             "small).")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Log every violation and fault line.")]


def set_threads(threads: int | None, model: ModelPreset) -> None:
    is_tiny = model in (ModelPreset.TINY, ModelPreset.HYBRID_SWA)
    torch.set_num_threads(threads or (1 if is_tiny else min(2, torch.get_num_threads())))


def canary_options(policy: Policy, real_kv: FingerprintMode, sweep_interval: int, sweep_budget: int,
                   truth: bool = True, stats_period: int = 0) -> CanaryOptions:
    return CanaryOptions(policy=policy, real_kv=_fingerprint_mode(real_kv), sweep_interval=sweep_interval,
                         sweep_budget=sweep_budget, truth=truth, stats_period=stats_period)
