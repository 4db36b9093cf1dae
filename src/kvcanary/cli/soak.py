"""``kv-canary soak``: a long clean run with every guarded mechanism exercised."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.table import Table

from kvcanary.cli._app import (
    MODELS,
    Device,
    DeviceName,
    Model,
    ModelSize,
    RealKV,
    RealKv,
    Seed,
    Threads,
    Verbose,
    app,
    console,
    progress_bar,
    set_threads,
    setup_logging,
)
from kvcanary.config import CanaryConfig, Policy
from kvcanary.engine.canary_hooks import attach_canary
from kvcanary.engine.engine import Engine
from kvcanary.engine.workload import WorkloadConfig, engine_config_for
from kvcanary.ops.fingerprint import FingerprintMode
from kvcanary.soak import MECHANISMS, SoakResult, run_soak, soak_workload

SOAK_WORKLOAD = WorkloadConfig(num_system_prompts=8, block_size=2)  # many prompts leave and come back


@app.command(help="Run the reference engine clean for --tokens generated tokens with prefix sharing, eviction, "
                  "offload and load-back, chunked prefill, aborts and preemption, the canary checking the real K/V "
                  "(--real-kv all) and sweeping every few steps. Prints how often each mechanism ran. Exit status 1 "
                  "when a mechanism never ran, a violation was reported or the watchdog fired.")
def soak(
    tokens: Annotated[int, typer.Option("--tokens", min=1, help="Generated tokens to run for (the default takes "
                                        "about a minute on two CPU cores).")] = 40_000,
    seed: Seed = 0,
    model: Model = ModelSize.tiny,
    device: Device = DeviceName.cpu,
    real_kv: RealKv = RealKV.all,
    sweep_interval: Annotated[int, typer.Option("--sweep-interval", min=1, help="Steps between sweeps of idle "
                                                "prefix-cache slots.")] = 4,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
    threads: Threads = None,
    verbose: Verbose = False,
) -> None:
    """A clean soak: mechanism counts on stdout, JSON with ``--json``."""
    set_threads(threads, model)
    setup_logging(logging.WARNING if verbose else logging.ERROR)
    if device is DeviceName.cuda and not torch.cuda.is_available():
        raise typer.BadParameter("CUDA is not available on this machine; use --device cpu", param_hint="--device")
    model_config = dataclasses.replace(MODELS[model.value], seed=seed)
    workload = soak_workload(tokens, dataclasses.replace(SOAK_WORKLOAD, seed=seed, vocab_size=model_config.vocab_size))
    canary = CanaryConfig(policy=Policy.LOG, real_kv=FingerprintMode[real_kv.name.upper()],
                          sweep_interval=sweep_interval)
    engine_config = engine_config_for(workload, device.value)
    engine, hooks = attach_canary(lambda h: Engine(model_config, engine_config, h), canary)
    with progress_bar() as progress:
        task = progress.add_task("generated tokens", total=tokens)
        result = run_soak(engine, hooks, workload, lambda n: progress.update(task, completed=min(n, tokens)))
    _print_soak(result, tokens)
    if json_path is not None:
        out = result.to_json() | {"tokens": tokens, "engine": engine.stats.as_dict(),
                                  "config": {"seed": seed, "model": model.value, "device": engine_config.device,
                                             "real_kv": real_kv.value, "sweep_interval": sweep_interval,
                                             "num_slots": engine_config.num_slots,
                                             "host_tier_slots": engine_config.host_tier_slots}}
        json_path.write_text(json.dumps(out, indent=2) + "\n")
        console.print(f"results written to {json_path}", highlight=False)
    if not result.passed:
        raise typer.Exit(1)


def _print_soak(result: SoakResult, tokens: int) -> None:
    table = Table(title=f"kv-canary soak: {result.generated_tokens} tokens ({tokens} asked), {result.requests} "
                        f"requests, {result.steps} steps, {result.wall_seconds:.1f} s; {result.protected_slots} "
                        f"slots stamped, {result.verified_slots} slot checks", title_justify="left")
    for col in ("mechanism", "count", "what"):
        table.add_column(col)
    for name, what in MECHANISMS.items():
        n = result.mechanisms[name]
        table.add_row(name, str(n) if n else "[red]0[/]", what)
    table.add_row("violations", f"[red]{result.violations}[/]" if result.violations else "0",
                  ", ".join(f"{k}={v}" for k, v in result.by_reason.items()) or "reported by the canary")
    table.add_row("watchdog alarms", f"[red]{result.watchdog_alarms}[/]" if result.watchdog_alarms else "0",
                  "launch points that stopped running")
    console.print(table)
    if result.passed:
        console.print("[green]soak passed: every mechanism exercised, no violation[/]")
    else:
        why = [f"never exercised: {', '.join(result.missing)}"] if result.missing else []
        why += [f"{result.violations} violations"] if result.violations else []
        why += [f"{result.watchdog_alarms} watchdog alarms"] if result.watchdog_alarms else []
        console.print(f"[red]soak failed: {'; '.join(why)}[/]")
