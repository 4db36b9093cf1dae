"""The ``kv-canary`` command line.

    kv-canary run    the built-in workload through the reference engine with the canary on;
                     summary, optional JSON report; exit 1 when a violation was reported
    kv-canary demo   self-test: a clean run, one run per fault kind, then one run per real-bug
                     zoo switch; exit 1 when a fault or bug was missed or a run reported a false
                     positive
    kv-canary soak   the reference engine clean for a token budget with every mechanism the canary
                     guards exercised; exit 1 when one was never exercised or a violation was reported

Configuration is built here, from the options, and passed down frozen.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import sys
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvcanary.config import CanaryConfig, Policy
from kvcanary.core.record import LaunchPoint
from kvcanary.engine.canary_hooks import attach_canary
from kvcanary.engine.config import ModelConfig
from kvcanary.engine.engine import Engine
from kvcanary.engine.workload import WorkloadConfig, builtin_workload, engine_config_for, load_prompts
from kvcanary.engine.zoo import CATALOGUE, Bug
from kvcanary.errors import ConfigError
from kvcanary.faults import FAULTS
from kvcanary.faults.campaign import RunOutcome, RunSetup, Verdict, default_faults, run_campaign, run_once
from kvcanary.faults.zoo_campaign import run_zoo, zoo_cases
from kvcanary.ops.fingerprint import FingerprintMode
from kvcanary.soak import MECHANISMS, SoakResult, run_soak, soak_workload

MODELS = {
    "tiny": ModelConfig(),
    "small": ModelConfig(vocab_size=512, hidden=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
                         intermediate=768),
}


class ModelSize(str, enum.Enum):
    tiny = "tiny"
    small = "small"


class DeviceName(str, enum.Enum):
    cpu = "cpu"
    cuda = "cuda"


class PolicyName(str, enum.Enum):
    off = "off"
    log = "log"
    raise_ = "raise"
    recompute = "recompute"


class RealKV(str, enum.Enum):
    none = "none"
    partial = "partial"
    all = "all"


app = typer.Typer(help="Make KV-cache corruption in LLM inference engines loud.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)
console = Console()
if not console.is_terminal:
    console.width = 132  # reports piped to a file or a CI log: no need to wrap at 80 columns
err_console = Console(stderr=True)

# --- shared options ------------------------------------------------------------------------------

Requests = Annotated[int, typer.Option("--requests", min=1, help="Requests of the built-in workload.")]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", min=2, help="Tokens each request generates.")]
Seed = Annotated[int, typer.Option("--seed", min=0, help="Seed of the workload, the model weights and the faults.")]
Model = Annotated[ModelSize, typer.Option("--model", help="tiny: hidden 64, 2 layers; small: hidden 256, 4 layers.")]
Device = Annotated[DeviceName, typer.Option("--device", help="Where the engine and the canary run.")]
RealKv = Annotated[RealKV, typer.Option("--real-kv", help="Fingerprint of the real K/V bytes: none, the first "
                                        "16 bytes of each row, or all of it.")]
SweepInterval = Annotated[int, typer.Option("--sweep-interval", min=0, help="Steps between sweeps of idle "
                                            "prefix-cache slots (0 = never).")]
SweepBudget = Annotated[int, typer.Option("--sweep-budget", min=1, help="Bytes one sweep may read.")]
Threads = Annotated[int | None, typer.Option("--threads", min=1, help="torch intra-op threads (default: 1 for "
                                             "tiny, whose small matmuls lose to thread barriers; 2 for small).")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Log every violation and fault line.")]


def _set_threads(threads: int | None, model: ModelSize) -> None:
    torch.set_num_threads(threads or (1 if model is ModelSize.tiny else min(2, torch.get_num_threads())))


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (the progress display redirects it), one
    unwrapped line per record, so violation lines stay parseable with ``VIOLATION_RE``."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _setup_logging(level: int) -> None:
    """Violation, fault and stats lines of the ``kvcanary`` loggers go to stderr at ``level``."""
    logger = logging.getLogger("kvcanary")
    for handler in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
        logger.removeHandler(handler)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


def _setup(requests: int, max_new_tokens: int, seed: int, model: ModelSize, device: DeviceName,
           canary: CanaryConfig, prompts: Path | None = None) -> RunSetup:
    if device is DeviceName.cuda and not torch.cuda.is_available():
        raise typer.BadParameter("CUDA is not available on this machine; use --device cpu", param_hint="--device")
    model_config = dataclasses.replace(MODELS[model.value], seed=seed)
    vocab = model_config.vocab_size
    try:
        if prompts is not None:
            workload = load_prompts(prompts, vocab)
        else:
            workload = builtin_workload(WorkloadConfig(num_requests=requests, max_new_tokens=max_new_tokens,
                                                       seed=seed, vocab_size=vocab))
    except (ConfigError, OSError) as e:
        raise typer.BadParameter(str(e), param_hint="--prompts" if prompts else "--requests") from None
    return RunSetup(model_config, engine_config_for(workload, device.value), canary, workload)


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err_console, transient=True)


def _tracker(progress: Progress, label: str, total: int):
    task = progress.add_task(label, total=total)
    return lambda done, n: progress.update(task, completed=done, total=n)


# --- run -----------------------------------------------------------------------------------------

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
    report: Annotated[Path | None, typer.Option("--report", help="Write the JSON report here.")] = None,
    threads: Threads = None,
    verbose: Verbose = False,
) -> None:
    """The main job: summary on stdout, JSON report with ``--report``."""
    _set_threads(threads, model)
    _setup_logging(logging.INFO if stats_period or verbose else logging.WARNING)
    try:
        canary = CanaryConfig(policy=Policy(policy.value), real_kv=FingerprintMode[real_kv.name.upper()],
                              sweep_interval=sweep_interval, sweep_budget_bytes=sweep_budget, truth=not no_truth,
                              stats_period=stats_period)
        faults = default_faults(fault or [], seed, fault_warmup)
    except (ConfigError, ValueError) as e:
        raise typer.BadParameter(str(e)) from None
    setup = _setup(requests, max_new_tokens, seed, model, device, canary, prompts)
    with _progress() as progress:
        out = run_once(setup, faults, _tracker(progress, "requests", setup.workload.num_requests))
    result = build_report(setup, out)
    _print_summary(result)
    if report is not None:
        report.write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"report written to {report}", highlight=False)
    if result["violations"] or result["watchdog_alarms"] or result["stopped"]:
        raise typer.Exit(1)


# --- demo ----------------------------------------------------------------------------------------

@app.command(help="Self-test: a clean run, then one run per fault kind, then one run per real-bug zoo switch "
                  "(kvcanary.engine.zoo), each checked for the expected reason and launch point. Exit status 1 when a "
                  "fault or bug was missed, a run reported a violation its fault or bug does not explain, or the clean "
                  "run reported anything.")
def demo(
    requests: Requests = 96,
    max_new_tokens: MaxNewTokens = 16,
    seed: Seed = 0,
    model: Model = ModelSize.tiny,
    device: Device = DeviceName.cpu,
    real_kv: RealKv = RealKV.partial,
    sweep_interval: SweepInterval = 4,
    sweep_budget: SweepBudget = 1 << 20,
    faults: Annotated[str, typer.Option("--faults", help="Comma-separated fault kinds to inject.")] = ",".join(FAULTS),
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Steps before each fault may act.")] = 24,
    bugs: Annotated[str, typer.Option("--bugs", help="Comma-separated zoo bugs to switch on, one run each "
                                      "(empty: no zoo runs).")] = ",".join(b.value for b in Bug),
    zoo_requests: Annotated[int, typer.Option("--zoo-requests", min=1, help="Requests of each zoo run's built-in "
                                              "workload.")] = 32,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
    threads: Threads = None,
    verbose: Verbose = False,
) -> None:
    """The fault matrix and the zoo on the built-in workload: tables on stdout, JSON with ``--json``."""
    _set_threads(threads, model)
    _setup_logging(logging.WARNING if verbose else logging.CRITICAL)
    names = [n.strip() for n in faults.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise typer.BadParameter(f"unknown fault(s) {unknown}; choose from {', '.join(FAULTS)}",
                                 param_hint="--faults")
    bug_names = [b.strip() for b in bugs.split(",") if b.strip()]
    unknown = [b for b in bug_names if b not in {x.value for x in Bug}]
    if unknown:
        raise typer.BadParameter(f"unknown bug(s) {unknown}; choose from {', '.join(b.value for b in Bug)}",
                                 param_hint="--bugs")
    canary = CanaryConfig(policy=Policy.LOG, real_kv=FingerprintMode[real_kv.name.upper()],
                          sweep_interval=sweep_interval, sweep_budget_bytes=sweep_budget)
    setup = _setup(requests, max_new_tokens, seed, model, device, canary)
    zoo_workload = WorkloadConfig(num_requests=zoo_requests, max_new_tokens=max_new_tokens, seed=seed,
                                  vocab_size=setup.model.vocab_size)
    cases = zoo_cases(setup.model, canary, zoo_workload, device.value, [Bug(b) for b in bug_names])
    with _progress() as progress:
        runs = progress.add_task("runs", total=1 + len(names) + len(cases))

        def per_run(label: str, total: int):
            if label != "clean":
                progress.advance(runs)
            return _tracker(progress, f"  {label}", total)

        result = run_campaign(setup, names, seed=seed, warmup_steps=warmup,
                              progress=lambda label: per_run(label, setup.workload.num_requests))
        zoo = run_zoo(cases, progress=lambda label: per_run(label, zoo_requests))
        progress.advance(runs)
    _print_fault_table(result)
    if zoo:
        _print_zoo_table(zoo)
    zoo_passed = all(v.detected and v.false_positives == 0 for v in zoo)
    passed = result.passed and zoo_passed
    if json_path is not None:
        out = result.to_json()
        out |= {"zoo": [v.to_json() for v in zoo], "zoo_passed": zoo_passed, "passed": passed}
        json_path.write_text(json.dumps(out, indent=2) + "\n")
        console.print(f"results written to {json_path}", highlight=False)
    if not all(v.injected for v in result.verdicts):
        console.print("a fault never acted: the run ended before --warmup steps or offered no target; raise "
                      "--requests or lower --warmup", highlight=False)
    if not all(v.injected for v in zoo):
        console.print("a zoo bug never acted: its workload never met its condition; raise --zoo-requests",
                      highlight=False)
    console.print("[green]all faults detected, all zoo bugs detected, clean run clean[/]" if passed
                  else "[red]self-test failed[/]")
    if not passed:
        raise typer.Exit(1)


def _status(v: Verdict, not_acted: str) -> str:
    return "[green]yes[/]" if v.detected else (f"[red]{not_acted}[/]" if not v.injected else "[red]MISSED[/]")


def _print_fault_table(result) -> None:
    table = Table(title="kv-canary demo: injected faults", title_justify="left")
    for col in ("fault", "expected", "first detection", "detected", "steps to detection", "false positives"):
        table.add_column(col)
    clean_ok = result.clean_violations == 0
    table.add_row("(none: clean run)", "no violation", f"{result.clean_violations} violations",
                  "[green]ok[/]" if clean_ok else "[red]FALSE POSITIVES[/]", "-", str(result.clean_violations))
    for v in result.verdicts:
        table.add_row(v.fault, v.expected, v.first_detection or "-", _status(v, "NOT INJECTED"),
                      "-" if v.steps_to_detection is None else str(v.steps_to_detection), str(v.false_positives))
    for v in getattr(result, "pending", []):
        table.add_row(v.fault, v.expected, "-", "pending", "-", "-")
    console.print(table)


def _print_zoo_table(verdicts: list[Verdict]) -> None:
    table = Table(title="kv-canary demo: real-bug zoo (kvcanary.engine.zoo)", title_justify="left")
    table.add_column("bug", no_wrap=True)
    table.add_column("re-creates", no_wrap=True)
    for col in ("expected", "first detection", "detected", "steps to detection", "false positives"):
        table.add_column(col)
    for v in verdicts:
        link = CATALOGUE[Bug(v.fault)].links[0]  # "https://github.com/org/repo/issues/N" -> "repo#N"
        ref = link.removeprefix("https://github.com/").replace("/pull/", "#").replace("/issues/", "#").split("/")[-1]
        table.add_row(v.fault, ref, v.expected, v.first_detection or "-", _status(v, "NOT TRIGGERED"),
                      "-" if v.steps_to_detection is None else str(v.steps_to_detection), str(v.false_positives))
    console.print(table)


# --- soak ----------------------------------------------------------------------------------------

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
    _set_threads(threads, model)
    _setup_logging(logging.WARNING if verbose else logging.ERROR)
    if device is DeviceName.cuda and not torch.cuda.is_available():
        raise typer.BadParameter("CUDA is not available on this machine; use --device cpu", param_hint="--device")
    model_config = dataclasses.replace(MODELS[model.value], seed=seed)
    workload = soak_workload(tokens, dataclasses.replace(SOAK_WORKLOAD, seed=seed, vocab_size=model_config.vocab_size))
    canary = CanaryConfig(policy=Policy.LOG, real_kv=FingerprintMode[real_kv.name.upper()],
                          sweep_interval=sweep_interval)
    engine_config = engine_config_for(workload, device.value)
    engine, hooks = attach_canary(lambda h: Engine(model_config, engine_config, h), canary)
    with _progress() as progress:
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
