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
from kvcanary.engine.config import Bug
from kvcanary.engine.workload import WorkloadConfig
from kvcanary.engine.zoo import CATALOGUE
from kvcanary.runs.setup import DemoOptions, ModelPreset, RunOptions, run_setup

DEMO = DemoOptions()  # the defaults of every option below
# the window and transfer runs need this much traffic: a stale transfer lands only on a slot freed and reused
SPLIT_MIN_REQUESTS = 16
ALL = "all"  # every kind


@app.command(help="Self-test: a clean run, then one run per fault kind, then one run per real-bug zoo switch "
                  "(kvcanary.engine.zoo), then the sliding-window faults on --model hybrid-swa and the transfer faults "
                  "on a prefill/decode split (each with its own clean run), each checked for the expected reason and "
                  "launch point (transfer faults on the decode side, the prefill side silent). Exit status 1 when a "
                  "fault or bug was missed, a run reported a violation its fault or bug does not explain, or the clean "
                  "run reported anything.")
def demo(
    requests: opt.Requests = DEMO.run.requests,
    max_new_tokens: opt.MaxNewTokens = DEMO.run.max_new_tokens,
    seed: opt.Seed = DEMO.run.seed,
    model: opt.Model = DEMO.run.model,
    device: opt.Device = DEMO.run.device,
    real_kv: opt.RealKv = opt.MODE_NAMES[DEMO.run.canary.real_kv],
    sweep_interval: opt.SweepInterval = DEMO.run.canary.sweep_interval,
    sweep_budget: opt.SweepBudget = DEMO.run.canary.sweep_budget,
    faults: Annotated[str, typer.Option("--faults", help="Comma-separated fault kinds to inject (all: every kind "
                                        "of kvcanary.faults.FAULTS).")] = ALL,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Steps before each fault may act.")] = (
        DEMO.run.fault_warmup),
    bugs: Annotated[str, typer.Option("--bugs", help="Comma-separated zoo bugs to switch on, one run each "
                                      "(empty: no zoo runs).")] = ",".join(b.value for b in Bug),
    zoo_requests: Annotated[int, typer.Option("--zoo-requests", min=1, help="opt.Requests of each zoo run's built-in "
                                              "workload.")] = DEMO.zoo_requests,
    window_faults: Annotated[str, typer.Option("--window-faults", help="Comma-separated sliding-window fault kinds, "
                                               "run on --model hybrid-swa (all: every kind; empty: none).")] = ALL,
    pd_faults: Annotated[str, typer.Option("--pd-faults", help="Comma-separated transfer fault kinds, run on a "
                                           "prefill/decode split (all: every kind; empty: none).")] = ALL,
    pd_warmup: Annotated[int, typer.Option("--pd-warmup", min=0, help="Decode-engine steps before each transfer "
                                           "fault may act.")] = DEMO.pd_warmup,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
    threads: opt.Threads = None,
    verbose: opt.Verbose = False,
) -> None:
    """The fault matrix and the zoo on the built-in workload: tables on stdout, JSON with ``--json``."""
    from kvcanary.faults import FAULTS, PD_FAULTS, WINDOW_FAULTS  # the demo is the fault code's user
    from kvcanary.runs.campaign import run_campaign, run_pd_campaign, run_zoo, zoo_cases

    opt.set_threads(threads, model)
    setup_logging(logging.WARNING if verbose else logging.CRITICAL)
    names = _names(faults, FAULTS, "--faults")
    window_names = _names(window_faults, WINDOW_FAULTS, "--window-faults")
    pd_names = _names(pd_faults, PD_FAULTS, "--pd-faults")
    bug_names = [b.strip() for b in bugs.split(",") if b.strip()]
    unknown = [b for b in bug_names if b not in {x.value for x in Bug}]
    if unknown:
        raise typer.BadParameter(f"unknown bug(s) {unknown}; choose from {', '.join(b.value for b in Bug)}",
                                 param_hint="--bugs")
    with options_checked():
        base = RunOptions(requests=requests, max_new_tokens=max_new_tokens, seed=seed, model=model, device=device,
                          canary=opt.canary_options(DEMO.run.canary.policy, real_kv, sweep_interval, sweep_budget))
        setup = run_setup(base)
        split = RunOptions(**{**base.__dict__, "requests": max(requests, SPLIT_MIN_REQUESTS)})
        window_setup = run_setup(RunOptions(**{**split.__dict__, "model": ModelPreset.HYBRID_SWA}))
        pd_model = ModelPreset.TINY if model is ModelPreset.HYBRID_SWA else model
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
    if not passed:
        raise typer.Exit(1)


def _names(text: str, known: dict, option: str) -> list[str]:
    """The kinds ``text`` names (``all``: every kind of ``known``, in its order)."""
    if text.strip() == ALL:
        return list(known)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise typer.BadParameter(f"unknown fault(s) {unknown}; choose from {', '.join(known)}", param_hint=option)
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
