"""``kv-canary bench``: kernel microbenchmarks and the end-to-end overhead study."""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Annotated

import typer

from kvcanary.cli import options as opt
from kvcanary.cli._app import app


class BenchWhat(str, enum.Enum):
    ops = "ops"
    overhead = "overhead"
    step = "step"
    all = "all"


@app.command(help="Benchmark the canary: 'ops' cross-checks and times every op (scatter, gather, build_plan, stamp, "
                  "verify, fingerprint) beside its bandwidth floor; 'overhead' measures the canary's device time per "
                  "step over the bandwidth floor of an 8B-shaped model's step, per mode (identity, real-KV partial / "
                  "all, sweeps, truth checks) and shape (decode bs 1/64/256 at 512/4096/32768, prefill of 16384 "
                  "tokens at bs 1 and 32); 'step' times a real 8B-shaped decoder step (CUDA only; exit status 2 "
                  "elsewhere) with the canary off and on, beside its floor; 'all' runs ops and overhead. On CUDA "
                  "every figure is a median in CUDA-graph replay; "
                  "on the CPU eager calls are timed with perf_counter. Prints a table last; exit status 1 when a "
                  "cross-check differs, a timed step reports a violation or a part fails.")
def bench(
    what: Annotated[str, typer.Argument(metavar="<ops|overhead|step|all>",
                                        help="ops, overhead, step, or all (ops and overhead).")] = "all",
    quick: Annotated[bool, typer.Option("--quick", help="Tiny shapes that run in seconds on the CPU.")] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write every number as JSON here.")] = None,
    markdown: Annotated[Path | None, typer.Option("--markdown", help="Write the overhead table as Markdown here.")]
    = None,
    device: Annotated[opt.DeviceChoice | None, typer.Option("--device", parser=opt.choice(opt.DeviceChoice),
                                                            metavar="<cpu|cuda>", help="cuda when available, else "
                                                            "cpu.")] = None,
    modes: Annotated[str | None, typer.Option("--modes", metavar="<mode,...>", help="Overhead modes, "
                                              "comma-separated (default: every mode; an unknown one lists "
                                              "them).")] = None,
    sweep_budget: Annotated[int, typer.Option("--sweep-budget", min=1, help="Bytes one sweep may read (overhead "
                                              "study).")] = 1 << 20,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of the random inputs.")] = 0,
) -> None:
    """Run the chosen benchmarks; JSON with ``--json``."""
    import torch

    from kvcanary.bench.op_cases import run_ops
    from kvcanary.bench.overhead import MODES, markdown_table, run_overhead
    from kvcanary.bench.step import run_step_command

    try:  # a plain argument, parsed here: typer versions differ on parsers of arguments
        what = opt.choice(BenchWhat)(what)
    except typer.BadParameter as e:
        raise typer.BadParameter(e.message, param_hint="'what'") from None
    device = None if device is None else opt.choice(opt.DeviceChoice)(device)
    if device is None:
        device = opt.DeviceChoice.CUDA if torch.cuda.is_available() else opt.DeviceChoice.CPU
    if device is opt.DeviceChoice.CUDA and not torch.cuda.is_available():
        raise typer.BadParameter("CUDA is not available on this machine; use --device cpu", param_hint="--device")
    chosen = None
    if modes is not None:
        chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
        known = {m.name for m in MODES}
        if not chosen or not set(chosen) <= known:
            raise typer.BadParameter(f"got {modes!r}; expected a comma-separated subset of {sorted(known)}",
                                     param_hint="--modes")
    dev = torch.device(device.value)
    if what is BenchWhat.step:
        raise typer.Exit(run_step_command(dev, quick=quick, json_path=json_path, markdown=markdown, seed=seed))
    single = what is not BenchWhat.all
    results, passed = {}, True
    if what in (BenchWhat.ops, BenchWhat.all):
        results["ops"] = run_ops(dev, quick=quick, json_path=json_path if single else None, seed=seed)
        passed &= results["ops"]["passed"]
        _write(json_path, results, single)
    if what in (BenchWhat.overhead, BenchWhat.all):
        print(flush=True)
        results["overhead"] = run_overhead(dev, quick=quick, json_path=json_path if single else None, seed=seed,
                                           modes=chosen, sweep_budget=sweep_budget)
        passed &= results["overhead"]["passed"]
        _write(json_path, results, single)
        if markdown is not None:
            markdown.write_text(markdown_table(results["overhead"]))
    if json_path is not None:
        print(f"results written to {json_path}")
    if not passed:
        raise typer.Exit(1)


def _write(path: Path | None, results: dict, single: bool) -> None:
    """``all`` writes both parts to one file, {"ops": ..., "overhead": ...}, after each part."""
    if path is not None and not single:
        path.write_text(json.dumps(results, indent=1, default=str) + "\n")
