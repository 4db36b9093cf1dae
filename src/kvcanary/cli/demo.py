"""``kv-canary demo``: the fault matrix and the real-bug zoo on the built-in workload."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvcanary.cli import options as opt
from kvcanary.cli._app import app, console, options_checked, progress_bar, setup_logging, tracker

DEMO = opt.DEMO  # the defaults of every option below
# the window and transfer runs need this much traffic: a stale transfer lands only on a slot freed and reused
SPLIT_MIN_REQUESTS = 16
ALL = opt.ALL  # every kind


def _kinds(help: str, *names: str):
    return typer.Option(*names, metavar="<kind,...>", help=help + " Comma-separated or repeated; all: every kind; "
                        "an empty value: none.")


@app.command(help="Self-test: a clean run, then one run per fault kind, then one run per real-bug zoo switch "
                  "(kvcanary.engine.zoo), then the sliding-window faults on --model hybrid-swa and the transfer faults "
                  "on a prefill/decode split (each with its own clean run), each checked for the expected reason and "
                  "launch point (transfer faults on the decode side, the prefill side silent). Exit status 1 when a "
                  "fault or bug was missed, a run reported a violation its fault or bug does not explain, or the clean "
                  "run reported anything.")
def demo(
    requests: opt.Requests = DEMO.requests,
    max_new_tokens: opt.MaxNewTokens = DEMO.max_new_tokens,
    seed: opt.Seed = DEMO.seed,
    model: opt.Model = DEMO.model.value,
    device: opt.Device = DEMO.device.value,
    real_kv: opt.RealKv = DEMO.real_kv.value,
    sweep_interval: opt.SweepInterval = DEMO.sweep_interval,
    sweep_budget: opt.SweepBudget = DEMO.sweep_budget,
    faults: Annotated[list[str], _kinds("Fault kinds to inject, one run each (kvcanary.faults.FAULTS).",
                                        "--faults", "--fault")] = [ALL],  # noqa: B006 (typer copies it)
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Steps before each fault may act.")] = (
        DEMO.fault_warmup),
    bugs: Annotated[list[str], _kinds("Zoo bugs to switch on, one run each (kvcanary.engine.zoo).",
                                      "--bugs")] = [ALL],  # noqa: B006
    zoo_requests: Annotated[int, typer.Option("--zoo-requests", min=1, help="Requests of each zoo run's built-in "
                                              "workload.")] = opt.DEMO_ZOO_REQUESTS,
    window_faults: Annotated[list[str], _kinds("Sliding-window fault kinds, run on --model hybrid-swa.",
                                               "--window-faults")] = [ALL],  # noqa: B006
    pd_faults: Annotated[list[str], _kinds("Transfer fault kinds, run on a prefill/decode split.",
                                           "--pd-faults")] = [ALL],  # noqa: B006
    pd_warmup: Annotated[int, typer.Option("--pd-warmup", min=0, help="Decode-engine steps before each transfer "
                                           "fault may act.")] = opt.DEMO_PD_WARMUP,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
    threads: opt.Threads = None,
    verbose: opt.Verbose = False,
) -> None:
    """The fault matrix and the zoo on the built-in workload: tables on stdout, JSON with ``--json``."""
    from kvcanary.engine.config import Bug
    from kvcanary.engine.workload import WorkloadConfig
    from kvcanary.faults import FAULTS, PD_FAULTS, WINDOW_FAULTS  # the demo is the fault code's user
    from kvcanary.runs.campaign import run_campaign, run_pd_campaign, run_zoo, zoo_cases
    from kvcanary.runs.setup import ModelPreset, RunOptions, run_setup

    opt.set_threads(threads, model)
    setup_logging(logging.WARNING if verbose else logging.CRITICAL)
    names = _names(faults, FAULTS, "--faults")
    window_names = _names(window_faults, WINDOW_FAULTS, "--window-faults")
    pd_names = _names(pd_faults, PD_FAULTS, "--pd-faults")
    bug_names = _names(bugs, {b.value: b for b in Bug}, "--bugs")
    with options_checked():
        preset = opt.model_preset(model)
        base = RunOptions(requests=requests, max_new_tokens=max_new_tokens, seed=seed, model=preset,
                          device=opt.device_name(device),
                          canary=opt.canary_options(DEMO.policy, real_kv, sweep_interval, sweep_budget))
        setup = run_setup(base)
        split = RunOptions(**{**base.__dict__, "requests": max(requests, SPLIT_MIN_REQUESTS)})
        window_setup = run_setup(RunOptions(**{**split.__dict__, "model": ModelPreset.HYBRID_SWA}))
        pd_model = ModelPreset.TINY if preset is ModelPreset.HYBRID_SWA else preset
        pd_setup = run_setup(RunOptions(**{**split.__dict__, "model": pd_model}))
    zoo_workload = WorkloadConfig(num_requests=zoo_requests, max_new_tokens=max_new_tokens, seed=seed,
                                  vocab_size=setup.model.vocab_size)
    cases = zoo_cases(setup.model, setup.canary, zoo_workload, device.value, [Bug(b) for b in bug_names])
    num_split = (1 + len(window_names) if window_names else 0) + (1 + len(pd_names) if pd_names else 0)
    split_requests = split.requests
    with progress_bar() as progress:
        runs = progress.add_task("runs", total=1 + len(names) + len(cases) + num_split)

        def per_run(label: str, total: int):
            if label != "clean":
                progress.advance(runs)
            return tracker(progress, f"  {label}", total)

        result = run_campaign(setup, names, seed=seed, warmup_steps=warmup,
                              progress=lambda label: per_run(label, setup.workload.num_requests))
        zoo = run_zoo(cases, progress=lambda label: per_run(label, zoo_requests))
        window = pd = None
        if window_names:
            window = run_campaign(window_setup, window_names, seed=seed, warmup_steps=warmup, pending=(),
                                  progress=lambda label: per_run(f"hybrid-swa {label}", split_requests))
        if pd_names:
            pd = run_pd_campaign(pd_setup, pd_names, seed=seed, warmup_steps=pd_warmup,
                                 progress=lambda label: per_run(label, split_requests))
        progress.advance(runs)
    passed = _report(result, zoo, window, pd, json_path)
    if not passed:
        raise typer.Exit(1)


def _report(result, zoo: list, window, pd, json_path: Path | None) -> bool:
    """Print the tables and the verdict, write the JSON; whether everything passed."""
    _print_fault_table(result)
    if zoo:
        _print_zoo_table(zoo)
    if window is not None or pd is not None:
        _print_split_table(window, pd)
    zoo_passed = all(v.detected and v.false_positives == 0 for v in zoo)
    split_verdicts = [*(window.verdicts if window else []), *(pd.verdicts if pd else [])]
    passed = (result.passed and zoo_passed and (window is None or window.passed) and (pd is None or pd.passed))
    if json_path is not None:
        out = result.to_json()
        out |= {"zoo": [v.to_json() for v in zoo], "zoo_passed": zoo_passed, "passed": passed,
                "window": window.to_json() if window else None, "pd": pd.to_json() if pd else None}
        json_path.write_text(json.dumps(out, indent=2) + "\n")
        console.print(f"results written to {json_path}", highlight=False)
    if not all(v.injected for v in [*result.verdicts, *split_verdicts]):
        console.print("a fault never acted: the run ended before --warmup steps or offered no target; raise "
                      "--requests or lower --warmup", highlight=False)
    if not all(v.injected for v in zoo):
        console.print("a zoo bug never acted: its workload never met its condition; raise --zoo-requests",
                      highlight=False)
    console.print("[green]all faults detected, all zoo bugs detected, clean run clean[/]" if passed
                  else "[red]self-test failed[/]")
    return passed


def _names(values: list[str], known: dict, option: str) -> list[str]:
    """The kinds ``values`` name (``all``: every kind of ``known``, in its order)."""
    names = opt.split_kinds(values)
    if ALL in names:
        return list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        what = "bug(s)" if option == "--bugs" else "fault(s)"
        raise typer.BadParameter(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(known)}",
                                 param_hint=option)
    return names


def _print_split_table(window, pd) -> None:
    """Sliding-window faults on hybrid-swa and transfer faults on the prefill/decode split, each
    after its clean run (for the split: violations on the prefill / decode side)."""
    table = Table(title="kv-canary demo: sliding-window pool (hybrid-swa) and prefill/decode split",
                  title_justify="left")
    for col in ("fault", "expected", "first detection", "detected", "steps to detection", "false positives"):
        table.add_column(col)
    for label, res in (("hybrid-swa", window), ("prefill/decode", pd)):
        if res is None:
            continue
        n = res.clean_violations
        table.add_row(f"(none: clean {label} run)", "no violation", f"{n} violations",
                      "[green]ok[/]" if n == 0 else "[red]FALSE POSITIVES[/]", "-", str(n))
        for v in res.verdicts:
            table.add_row(v.fault, v.expected, v.first_detection or "-", _status(v, "NOT INJECTED"),
                          "-" if v.steps_to_detection is None else str(v.steps_to_detection), str(v.false_positives))
    console.print(table)


def _status(v, not_acted: str) -> str:
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


def _print_zoo_table(verdicts: list) -> None:
    from kvcanary.engine.config import Bug
    from kvcanary.engine.zoo import CATALOGUE

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
