"""``kv-canary run``: the built-in workload with the canary on; summary and JSON report."""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvcanary.cli._app import (
    Device,
    DeviceName,
    MaxNewTokens,
    Model,
    ModelSize,
    PolicyName,
    RealKV,
    RealKv,
    Requests,
    Seed,
    SweepBudget,
    SweepInterval,
    Threads,
    Verbose,
    app,
    console,
    make_setup,
    progress_bar,
    set_threads,
    setup_logging,
    tracker,
)
from kvcanary.config import CanaryConfig, Policy
from kvcanary.core.record import LaunchPoint
from kvcanary.errors import ConfigError
from kvcanary.faults import FAULTS
from kvcanary.faults.campaign import RunOutcome, RunSetup, default_faults, run_once
from kvcanary.ops.fingerprint import FingerprintMode
from kvcanary.runtime.incidents import incidents_report


def build_report(setup: RunSetup, out: RunOutcome) -> dict:
    """The JSON report of a run: workload counts, violations, canary and engine counters."""
    canary = out.hooks.canary
    totals, counters = canary.totals, canary.counters()
    step_seconds = out.counts["step_seconds"]
    counts = {k: v for k, v in out.counts.items() if k != "request_ids"}
    return {
        **counts,
        "violations": max(counters["ring_total"], len(out.violations)),  # rows dropped by a full ring included
        "violations_decoded": len(out.violations),
        "by_reason": dict(sorted(totals.by_reason.items())),
        "by_launch_point": {p.name: totals.by_launch_point.get(p.name, 0) for p in LaunchPoint},
        "canary_time_share": totals.seconds / step_seconds if step_seconds > 0 else 0.0,
        "canary_seconds": totals.seconds,
        "wall_seconds": out.wall_seconds,
        "protected_slots": counters["HEAD"]["stamped"],
        "verified_slots": sum(counters[p.name]["checked"] for p in LaunchPoint),
        "sweeps": totals.sweeps,
        "watchdog_alarms": len(out.alarms),
        "stopped": out.error,
        "engine": out.engine.stats.as_dict(),
        "canary": {"forwards": totals.forwards, "steps": totals.steps, "sweeps": totals.sweeps,
                   "violations": totals.violations, "recomputed_requests": totals.recomputed_requests,
                   "watchdog_alarms": totals.watchdog_alarms, "seconds": totals.seconds, "counters": counters},
        "injections": [{"fault": i.fault, "step": i.step, "slot": i.slot, "detail": i.detail}
                       for i in out.injections],
        "config": {"policy": setup.canary.policy.value, "real_kv": setup.canary.real_kv.name.lower(),
                   "sweep_interval": setup.canary.sweep_interval, "sweep_budget": setup.canary.sweep_budget_bytes,
                   "truth": setup.canary.truth, "device": setup.engine.device,
                   "model": {f.name: getattr(setup.model, f.name) for f in dataclasses.fields(setup.model)
                             if f.name != "dtype"},
                   "engine": {k: getattr(setup.engine, k) for k in ("num_slots", "max_ctx", "chunk_size",
                                                                    "max_running", "host_tier_slots")}},
        "first_violations": [v.to_json() for v in out.violations[:20]],
        **incidents_report([c for c in (canary, out.hooks.window_canary) if c is not None]),
        "timeline": out.timeline,
        "window_pool": out.hooks.window_report(),  # None without sliding-window layers
    }


def _print_summary(report: dict) -> None:
    eng = report["engine"]
    table = Table(title="kv-canary run", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [
        ("requests", f"{report['requests']} ({report['finished']} finished, {report['aborted']} aborted)"),
        ("generated tokens", report["generated_tokens"]),
        ("steps", report["steps"]),
        ("protected slots (stamped)", report["protected_slots"]),
        ("verified slots", report["verified_slots"]),
        ("sweeps", report["sweeps"]),
        ("evicted / offloaded / loaded-back slots",
         f"{eng['num_evicted_slots']} / {eng['num_offloaded_slots']} / {eng['num_loaded_slots']}"),
        ("aborts / preemptions / recomputes",
         f"{eng['num_aborts']} / {eng['num_preemptions']} / {eng['num_recomputes']}"),
        ("canary time share", f"{report['canary_time_share']:.1%} ({report['canary_seconds']:.2f} s of "
                              f"{report['step_seconds']:.2f} s stepping)"),
        ("violations", report["violations"]),
    ]
    if "incidents" in report:
        rows.append(("incidents (damaged slot x reason)", f"{report['incidents']} ({report['redetections']} "
                     "re-detections)"))
    rows += _split_rows(report)
    for name, value in rows:
        table.add_row(name, str(value))
    if report["violations"]:
        table.add_row("  by reason", ", ".join(f"{k}={v}" for k, v in report["by_reason"].items()))
        table.add_row("  by launch point", ", ".join(f"{k}={v}" for k, v in report["by_launch_point"].items() if v))
    if report["watchdog_alarms"]:
        table.add_row("watchdog alarms", str(report["watchdog_alarms"]))
    console.print(table)
    if report["stopped"]:
        console.print(f"[bold red]stopped:[/] {report['stopped']}", markup=True, highlight=False)


def _split_rows(report: dict) -> list[tuple[str, object]]:
    """Rows of a sliding-window model's window pool and of a prefill/decode split, when present."""
    rows: list[tuple[str, object]] = []
    win = report.get("window_pool")
    if win:
        rows += [(f"window pool (W={win['window']}, {win['window_slots']} slots)",
                  f"{win['translated_positions']} translated / {win['slid_out_positions']} slid out / "
                  f"{win['reused_window_slots']} reused"),
                 ("  window checks / violations", f"{win['verified_slots']} / {win['violations']}")]
    if "transfer" in report:
        t = report["transfer"]
        rows += [("transferred requests / slots", f"{t['requests']} / {t['slots']}"),
                 ("violations prefill / decode", f"{report['prefill']['violations']} / "
                                                 f"{report['decode']['violations']}")]
    return rows


class EngineName(str, enum.Enum):
    reference = "reference"
    transformers = "transformers"


@app.command(help="Run the built-in workload through the reference engine with the canary on. Exit status 0 "
                  "when the canary reported nothing, 1 when it reported a violation (or its watchdog fired, or the "
                  "raise policy stopped the run).")
def run(
    requests: Requests = 128,
    max_new_tokens: MaxNewTokens = 16,
    seed: Seed = 0,
    model: Model = ModelSize.tiny,
    device: Device = DeviceName.cpu,
    policy: Annotated[PolicyName, typer.Option("--policy", help="off: no checks; log: report and keep "
                                               "serving; raise: stop at the first violation; recompute: "
                                               "quarantine the slots and re-prefill the requests.")] = PolicyName.log,
    real_kv: RealKv = RealKV.partial,
    sweep_interval: SweepInterval = 8,
    sweep_budget: SweepBudget = 1 << 20,
    no_truth: Annotated[bool, typer.Option("--no-truth", help="Do not check tokens against the requests' "
                                           "token history.")] = False,
    stats_period: Annotated[int, typer.Option("--stats-period", min=0, help="Steps between canary stats "
                                              "lines (0 = never).")] = 0,
    prompts: Annotated[Path | None, typer.Option("--prompts", help="JSONL file of {\"prompt_ids\": [...], "
                                                 "\"max_new_tokens\": N} lines instead of the built-in "
                                                 "workload (--requests and --max-new-tokens are then "
                                                 "ignored).")] = None,
    fault: Annotated[list[str] | None, typer.Option("--fault", help=f"Inject a fault (repeatable): "
                                                    f"{', '.join(FAULTS)}.")] = None,
    fault_warmup: Annotated[int, typer.Option("--fault-warmup", min=0, help="Steps before a fault may "
                                              "act.")] = 24,
    report: Annotated[Path | None, typer.Option("--report", help="Write the JSON report here, and an HTML "
                                                 "incident report with a PNG timeline next to it.")] = None,
    engine: Annotated[EngineName, typer.Option("--engine", help="reference: the embedded engine; transformers: "
                                               "Hugging Face transformers continuous batching with a tiny "
                                               "random Llama (kvcanary.adapters.transformers).")] = (
        EngineName.reference),
    tp: Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel ranks of the reference engine, one "
                                    "process each (gloo on CPU, NCCL on CUDA); reports per rank.")] = 1,
    pd: Annotated[bool, typer.Option("--pd", help="Prefill/decode split: one reference engine prefills, a second "
                                     "receives the K/V and canary rows and decodes.")] = False,
    threads: Threads = None,
    verbose: Verbose = False,
) -> None:
    """The main job: summary on stdout, JSON report with ``--report``."""
    set_threads(threads, model)
    setup_logging(logging.INFO if stats_period or verbose else logging.WARNING)
    try:
        canary = CanaryConfig(policy=Policy(policy.value), real_kv=FingerprintMode[real_kv.name.upper()],
                              sweep_interval=sweep_interval, sweep_budget_bytes=sweep_budget, truth=not no_truth,
                              stats_period=stats_period)
        faults = default_faults(fault or [], seed, fault_warmup)
    except (ConfigError, ValueError) as e:
        raise typer.BadParameter(str(e)) from None
    modes = [name for name, on in (("--engine transformers", engine is EngineName.transformers),
                                   ("--tp", tp > 1), ("--pd", pd)) if on]
    if len(modes) > 1:
        raise typer.BadParameter(f"{' and '.join(modes)} cannot be combined; choose one")
    setup = make_setup(requests, max_new_tokens, seed, model, device, canary, prompts)
    with progress_bar() as progress:
        track = tracker(progress, "requests", setup.workload.num_requests)
        if engine is EngineName.transformers:
            from kvcanary.cli.transformers_run import run_transformers

            result = run_transformers(setup, faults, track)
        elif tp > 1:
            from kvcanary.cli.tp_run import run_tp

            result = run_tp(setup, tp, faults, track)
        elif pd:
            from kvcanary.cli.pd_run import run_pd

            result = run_pd(setup, faults, track)
        else:
            result = build_report(setup, run_once(setup, faults, track))
    _print_summary(result)
    if report is not None:
        report.write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"report written to {report}", highlight=False)
        from kvcanary.incident import write_incident

        page = report.with_suffix(".html") if report.suffix != ".html" else report.with_name(report.name + ".html")
        try:
            write_incident(result, page, title=f"kv-canary run: {report.name}")
            console.print(f"incident report written to {page}", highlight=False)
        except ImportError:  # matplotlib comes with the server extra
            console.print("no HTML incident report: install kv-canary[server] for matplotlib", highlight=False,
                          markup=False)
    if result["violations"] or result["watchdog_alarms"] or result["stopped"]:
        raise typer.Exit(1)
