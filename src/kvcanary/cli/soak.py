"""``kv-canary soak``: a long clean run with every guarded mechanism exercised."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from kvcanary.cli import options as opt
from kvcanary.cli._app import app, console, options_checked, progress_bar, setup_logging

if TYPE_CHECKING:
    from kvcanary.runs.soak import SoakReport

SOAK = opt.SOAK  # the defaults of every option below


@app.command(help="Run the reference engine clean for --tokens generated tokens with prefix sharing, eviction, "
                  "offload and load-back, chunked prefill, aborts and preemption, the canary checking the real K/V "
                  "(--real-kv all) and sweeping every few steps. Prints how often each mechanism ran. Exit status 1 "
                  "when a mechanism never ran, a violation was reported or the watchdog fired.")
def soak(
    tokens: Annotated[int, typer.Option("--tokens", min=1, help="Generated tokens to run for (the default takes "
                                        "about a minute on two CPU cores).")] = opt.SOAK_TOKENS,
    seed: opt.Seed = SOAK.seed,
    model: opt.Model = SOAK.model.value,
    device: opt.Device = SOAK.device.value,
    real_kv: opt.RealKv = SOAK.real_kv.value,
    sweep_interval: Annotated[int, typer.Option("--sweep-interval", min=1, help="Steps between sweeps of idle "
                                                "prefix-cache slots.")] = SOAK.sweep_interval,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
    threads: opt.Threads = None,
    verbose: opt.Verbose = False,
) -> None:
    """A clean soak: mechanism counts on stdout, JSON with ``--json``."""
    opt.set_threads(threads, model)
    setup_logging(logging.WARNING if verbose else logging.ERROR)
    from kvcanary.runs.setup import SoakOptions
    from kvcanary.runs.soak import soak as run_soak

    with options_checked():
        options = SoakOptions(tokens=tokens, seed=seed, model=opt.model_preset(model), device=opt.device_name(device),
                              canary=opt.canary_options(SOAK.policy, real_kv, sweep_interval, SOAK.sweep_budget))
        with progress_bar() as progress:
            task = progress.add_task("generated tokens", total=tokens)
            result = run_soak(options, lambda n: progress.update(task, completed=min(n, tokens)))
    _print_soak(result, tokens)
    if json_path is not None:
        out = result.to_json() | {"tokens": tokens,
                                  "config": {"seed": seed, "model": model.value, **result.config,
                                             "real_kv": options.canary.real_kv.name.lower(),
                                             "sweep_interval": sweep_interval}}
        json_path.write_text(json.dumps(out, indent=2) + "\n")
        console.print(f"results written to {json_path}", highlight=False)
    if not result.passed:
        raise typer.Exit(1)


def _print_soak(result: SoakReport, tokens: int) -> None:
    from kvcanary.runs.soak import MECHANISMS

    c = result.canary
    n = result.counts
    table = Table(title=f"kv-canary soak: {n.generated_tokens} tokens ({tokens} asked), {n.requests} "
                        f"requests, {n.steps} steps, {result.wall_seconds:.1f} s; {c.protected_slots} slots "
                        f"stamped, {c.verified_slots} slot checks", title_justify="left")
    for col in ("mechanism", "count", "what"):
        table.add_column(col)
    for name, what in MECHANISMS.items():
        n = result.mechanisms[name]
        table.add_row(name, str(n) if n else "[red]0[/]", what)
    table.add_row("violations", f"[red]{c.violations}[/]" if c.violations else "0",
                  ", ".join(f"{k}={v}" for k, v in sorted(c.by_reason.items())) or "reported by the canary")
    table.add_row("watchdog alarms", f"[red]{c.watchdog_alarms}[/]" if c.watchdog_alarms else "0",
                  "launch points that stopped running")
    console.print(table)
    if result.passed:
        console.print("[green]soak passed: every mechanism exercised, no violation[/]")
    else:
        why = [f"never exercised: {', '.join(result.missing)}"] if result.missing else []
        why += [f"{c.violations} violations"] if c.violations else []
        why += [f"{c.watchdog_alarms} watchdog alarms"] if c.watchdog_alarms else []
        console.print(f"[red]soak failed: {'; '.join(why)}[/]")
