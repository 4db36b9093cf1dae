"""``kv-canary run --tp N``: the built-in workload on N local tensor-parallel ranks, one process each
(gloo on the CPU, NCCL on CUDA, rank r on ``cuda:r``), reported per rank and over all ranks.

Injected faults act on the last rank only, so the other ranks learn of them through the
agreement alone (``kvcanary.distributed``). Each rank's report is ``build_report``'s plus
``rank``, ``rank_divergences`` and ``recoveries``; the run's report sums violations and checks
over the ranks (workload counts and engine stats are the same on every rank: rank 0's).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import queue
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import typer
from rich.table import Table

from kvcanary.cli._app import console
from kvcanary.distributed import RanksOutOfStep
from kvcanary.engine.tp import RankCanaryHooks, build_rank_engine, rank_model_config
from kvcanary.engine.workload import Progress, run_workload
from kvcanary.errors import CanaryViolation, ConfigError
from kvcanary.faults.base import Fault
from kvcanary.faults.campaign import RunOutcome, RunSetup, partial_counts
from kvcanary.faults.hooks import FaultHooks
from kvcanary.runtime.canary import WatchdogTimeout

STOPPING = (CanaryViolation, WatchdogTimeout, RanksOutOfStep)


@dataclass(frozen=True)
class RankJob:
    """One run of ``setup`` on every rank; ``faults`` act on rank ``fault_rank`` only (-1: the last).
    ``keep_outputs``: add every request's output ids to the rank's report."""

    name: str
    setup: RunSetup
    faults: tuple[Fault, ...] = ()
    fault_rank: int = -1
    keep_outputs: bool = False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, world: int, port: int, device: str, timeout_s: float = 300.0) -> None:
    """Join the local process group: NCCL on ``cuda:rank`` when ``device`` is CUDA, gloo otherwise."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def run_rank_job(job: RankJob, progress: Progress | None = None) -> dict:
    """Run ``job`` on this rank (the process group is initialised); returns the rank's report."""
    from kvcanary.cli.run import build_report  # run.py dispatches here: import late

    rank, world = dist.get_rank(), dist.get_world_size()
    setup = job.setup
    if setup.engine.device.startswith("cuda"):
        setup = dataclasses.replace(setup, engine=dataclasses.replace(setup.engine, device=f"cuda:{rank}"))
    fault_rank = job.fault_rank % world
    hooks = RankCanaryHooks(setup.canary)
    fault_hooks = FaultHooks(hooks, job.faults if rank == fault_rank else ())
    engine = build_rank_engine(setup.model, setup.engine, fault_hooks)
    hooks.attach(engine)
    fault_hooks.attach(engine)
    error, stopped_with, t0 = None, [], time.perf_counter()
    try:
        counts = run_workload(engine, setup.workload, progress)
        hooks.finish()
    except STOPPING as e:  # on every rank in the same step: the agreement applies the policy in lock-step
        hooks.agreement.drain()
        error, stopped_with = f"rank {rank}: {e}", getattr(e, "violations", [])
        counts = partial_counts(engine, time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    violations = [v for r in hooks.reports for v in r.violations]
    reported = {id(v) for v in violations}
    violations += [v for v in stopped_with if id(v) not in reported]  # those of the step that stopped the run
    alarms = [a for r in hooks.reports for a in r.alarms]
    out = RunOutcome(engine, hooks, counts, violations, fault_hooks.injections, wall, error, alarms)
    report = build_report(setup, out)
    agreement = hooks.agreement
    divergences = agreement.divergences
    report["violations"] += len(divergences)
    report["agreement_seconds"] = agreement.seconds  # counted in the canary's time
    report["canary_seconds"] += agreement.seconds
    report["canary_time_share"] = report["canary_seconds"] / counts["step_seconds"] if counts["step_seconds"] else 0.0
    if divergences:
        report["by_reason"]["rank_divergence"] = len(divergences)
    report.update(rank=rank, world=world, rank_divergences=[d.to_json() for d in divergences],
                  recoveries=[{"step": step, "requests": list(rec.requests), "slots": list(rec.slots),
                               "since_step": rec.since_step} for step, rec in hooks.recoveries])
    if job.keep_outputs:
        report["outputs"] = [engine.output_ids(i) for i in counts["request_ids"]]
    return report


class _ProgressSender:
    """Rank 0's progress callback: sends (done, total) to the parent when ``done`` changes."""

    def __init__(self, results, name: str):
        self.results, self.name, self.last = results, name, -1

    def __call__(self, done: int, total: int) -> None:
        if done != self.last:
            self.last = done
            self.results.put(("progress", self.name, (done, total)))


def _rank_main(rank: int, world: int, port: int, jobs: Sequence[RankJob], results, log_level: int,
               threads: int) -> None:
    """Entry point of one rank's process: join the group, run the jobs, send each report."""
    torch.set_num_threads(threads)
    logger = logging.getLogger("kvcanary")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(log_level)
    logger.propagate = False
    init_rank(rank, world, port, jobs[0].setup.engine.device)
    try:
        for job in jobs:
            progress = _ProgressSender(results, job.name) if rank == 0 else None
            results.put(("report", job.name, run_rank_job(job, progress)))
    finally:
        dist.destroy_process_group()


def spawn_ranks(world: int, jobs: Sequence[RankJob], progress: Callable[[str, int, int], None] | None = None,
                threads: int = 1, target: Callable = _rank_main) -> dict[str, list]:
    """Run ``jobs`` in order on ``world`` local ranks, one process each; returns job name -> the
    ranks' reports in rank order. Raises the first rank's exception if a rank fails. ``target``:
    the processes' entry point (``_rank_main``'s signature; it sends ``("report", name, report)``
    with ``report["rank"]`` for every job)."""
    results = mp.get_context("spawn").Queue()
    level = logging.getLogger("kvcanary").getEffectiveLevel()
    ctx = mp.spawn(target, args=(world, free_port(), list(jobs), results, level, threads), nprocs=world,
                   join=False)
    reports: dict[str, list[dict]] = {job.name: [] for job in jobs}

    def drain() -> None:
        while True:
            try:
                kind, name, payload = results.get_nowait()
            except queue.Empty:
                return
            if kind == "progress":
                if progress is not None:
                    progress(name, *payload)
            else:
                reports.setdefault(name, []).append(payload)

    while not ctx.join(timeout=0.05):
        drain()
    time.sleep(0.05)  # the queue's feeder threads flush before their process exits
    drain()
    missing = [name for name, rs in reports.items() if len(rs) != world]
    if missing:
        raise RuntimeError(f"ranks exited without reporting jobs {missing}")
    return {name: sorted(rs, key=lambda r: r["rank"]) for name, rs in reports.items()}


def aggregate(ranks: list[dict]) -> dict:
    """One report over the ranks: rank 0's workload counts and engine stats, the checks and
    violations summed, the canary's time share the largest, ``ranks`` the per-rank reports."""
    out = dict(ranks[0])
    for key in ("violations", "violations_decoded", "protected_slots", "verified_slots", "sweeps", "watchdog_alarms"):
        out[key] = sum(r[key] for r in ranks)
    for key in ("by_reason", "by_launch_point"):
        total: Counter = Counter()
        for r in ranks:
            total.update(r[key])
        out[key] = dict(sorted(total.items())) if key == "by_reason" else {k: total[k] for k in ranks[0][key]}
    for key in ("canary_time_share", "canary_seconds", "agreement_seconds", "step_seconds", "wall_seconds"):
        out[key] = max(r[key] for r in ranks)
    out["stopped"] = next((r["stopped"] for r in ranks if r["stopped"]), None)
    out["first_violations"] = [{"rank": r["rank"], **v} for r in ranks for v in r["first_violations"]][:20]
    out["injections"] = [{"rank": r["rank"], **i} for r in ranks for i in r["injections"]]
    out["config"] = {**ranks[0]["config"], "tp": len(ranks)}
    out["ranks"] = [{k: v for k, v in r.items() if k != "outputs"} for r in ranks]
    for key in ("rank", "rank_divergences", "recoveries", "outputs"):
        out.pop(key, None)
    return out


def print_ranks(ranks: list[dict]) -> None:
    table = Table(title="per rank", title_justify="left")
    for name in ("rank", "protected", "verified", "violations", "by reason", "rank divergences", "recomputes",
                 "canary share", "stopped"):
        table.add_column(name, justify="left" if name in ("by reason", "stopped") else "right")
    for r in ranks:
        table.add_row(str(r["rank"]), str(r["protected_slots"]), str(r["verified_slots"]), str(r["violations"]),
                      ", ".join(f"{k}={v}" for k, v in r["by_reason"].items()) or "-",
                      str(len(r["rank_divergences"])), str(r["engine"]["num_recomputes"]),
                      f"{r['canary_time_share']:.1%}", "yes" if r["stopped"] else "-")
    console.print(table)


def run_tp(setup: RunSetup, tp: int, faults: Sequence[Fault], progress: Progress | None = None) -> dict:
    """The built-in workload on ``tp`` local ranks (``faults`` on the last); prints the per-rank
    table and returns the aggregated report (``ranks``: per-rank reports)."""
    if setup.engine.device.startswith("cuda") and torch.cuda.device_count() < tp:
        raise typer.BadParameter(f"{tp} ranks need {tp} CUDA devices, found {torch.cuda.device_count()}",
                                 param_hint="--tp")
    try:
        rank_model_config(setup.model, tp)  # a clear error before any process starts
    except ConfigError as e:
        raise typer.BadParameter(str(e), param_hint="--tp") from None
    threads = max(1, torch.get_num_threads() // tp)
    job = RankJob("run", setup, tuple(faults))
    ranks = spawn_ranks(tp, [job], (lambda name, done, total: progress(done, total)) if progress else None,
                        threads)["run"]
    print_ranks(ranks)
    return aggregate(ranks)
