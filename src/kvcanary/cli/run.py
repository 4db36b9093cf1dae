"""``kv-canary run``: options -> ``RunOptions`` -> ``kvcanary.runs.run`` -> summary, JSON report."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from kvcanary.cli import options as opt
from kvcanary.cli._app import app, console, options_checked, progress_bar, require_extra, setup_logging, tracker

if TYPE_CHECKING:
    from kvcanary.runs.report import RunReport

RUN = opt.RUN  # the defaults of every option below


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


@app.command(help="Run the built-in workload through the reference engine with the canary on. Exit status 0 "
                  "when the canary reported nothing, 1 when it reported a violation (or its watchdog fired, or the "
                  "raise policy stopped the run).")
def run(
    requests: opt.Requests = RUN.requests,
    max_new_tokens: opt.MaxNewTokens = RUN.max_new_tokens,
    seed: opt.Seed = RUN.seed,
    model: opt.Model = RUN.model.value,
    device: opt.Device = RUN.device.value,
    policy: opt.PolicyOption = RUN.policy.value,
    real_kv: opt.RealKv = RUN.real_kv.value,
    sweep_interval: opt.SweepInterval = RUN.sweep_interval,
    sweep_budget: opt.SweepBudget = RUN.sweep_budget,
    no_truth: Annotated[bool, typer.Option("--no-truth", help="Do not check tokens against the requests' "
                                           "token history.")] = not RUN.truth,
    stats_period: Annotated[int, typer.Option("--stats-period", min=0, help="Steps between canary stats "
                                              "lines (0 = never).")] = RUN.stats_period,
    prompts: Annotated[Path | None, typer.Option("--prompts", help="JSONL file of {\"prompt_ids\": [...], "
                                                 "\"max_new_tokens\": N} lines instead of the built-in "
                                                 "workload (--requests and --max-new-tokens are then "
                                                 "ignored).")] = None,
    faults: Annotated[list[str] | None, typer.Option("--faults", "--fault", metavar="<kind,...>",
                                                     help="Fault kinds to inject, comma-separated or repeated; "
                                                     "`kv-canary demo --help` names them, an unknown one lists "
                                                     "them.")] = None,
    fault_warmup: Annotated[int, typer.Option("--fault-warmup", min=0, help="Steps before a fault may "
                                              "act.")] = RUN.fault_warmup,
    report: Annotated[Path | None, typer.Option("--report", help="Write the JSON report here, and an HTML "
                                                 "incident report with a PNG timeline next to it.")] = None,
    engine: opt.Engine = RUN.engine.value,
    tp: Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel ranks of the reference engine, one "
                                    "process each (gloo on CPU, NCCL on CUDA); reports per rank.")] = RUN.tp,
    pd: Annotated[bool, typer.Option("--pd", help="Prefill/decode split: one reference engine prefills, a second "
                                     "receives the K/V and canary rows and decodes.")] = RUN.pd,
    threads: opt.Threads = None,
    verbose: opt.Verbose = False,
) -> None:
    """The main job: summary on stdout, JSON report with ``--report``."""
    opt.set_threads(threads, model)
    setup_logging(logging.INFO if stats_period or verbose else logging.WARNING)
    if opt.EngineChoice(engine) is opt.EngineChoice.TRANSFORMERS:
        require_extra("transformers", "transformers", "--engine transformers")
    from kvcanary.runs.run import run as run_options
    from kvcanary.runs.setup import RunOptions

    with options_checked():
        options = RunOptions(
            requests=requests, max_new_tokens=max_new_tokens, seed=seed, model=opt.model_preset(model),
            device=opt.device_name(device),
            canary=opt.canary_options(policy, real_kv, sweep_interval, sweep_budget, not no_truth, stats_period),
            prompts=prompts, faults=tuple(opt.split_kinds(faults)), fault_warmup=fault_warmup,
            engine=opt.engine_kind(engine), tp=tp, pd=pd)
        with progress_bar() as progress:
            total = options.requests if prompts is None else 0
            result = run_options(options, tracker(progress, "requests", total))
    if result.ranks:
        _print_ranks(result.ranks)
    data = result.to_json()
    _print_summary(data)
    if report is not None:
        _write_report(data, report)
    if not result.is_clean:
        raise typer.Exit(1)


def _write_report(data: dict, report: Path) -> None:
    report.write_text(json.dumps(data, indent=2) + "\n")
    console.print(f"report written to {report}", highlight=False)
    page = report.with_suffix(".html") if report.suffix != ".html" else report.with_name(report.name + ".html")
    try:
        from kvcanary.incident import write_incident

        write_incident(data, page, title=f"kv-canary run: {report.name}")
        console.print(f"incident report written to {page}", highlight=False)
    except ImportError:  # matplotlib comes with the server extra
        console.print("no HTML incident report: install kv-canary[server] for matplotlib", highlight=False,
                      markup=False)


def _print_ranks(ranks: list[RunReport]) -> None:
    table = Table(title="per rank", title_justify="left")
    for name in ("rank", "protected", "verified", "violations", "by reason", "rank divergences", "recomputes",
                 "canary share", "stopped"):
        table.add_column(name, justify="left" if name in ("by reason", "stopped") else "right")
    for r in ranks:
        c = r.canary
        table.add_row(str(r.rank.rank), str(c.protected_slots), str(c.verified_slots), str(c.violations),
                      ", ".join(f"{k}={v}" for k, v in sorted(c.by_reason.items())) or "-",
                      str(len(r.rank.rank_divergences)), str(r.engine["num_recomputes"]),
                      f"{r.canary_time_share:.1%}", "yes" if r.stopped else "-")
    console.print(table)
