"""``kv-canary run --tp N``: the workload on N local tensor-parallel ranks, one process each
(gloo on the CPU, NCCL on CUDA, rank r on ``cuda:r``), reported per rank and over all ranks.

Injected faults act on the last rank only, so the other ranks learn of them through the
agreement alone (``kvcanary.distributed``). Each rank's report is a single run's plus its
``RankSection`` (divergences, recoveries); ``merge_ranks`` sums violations and checks over the
ranks (workload counts and engine stats are the same on every rank: rank 0's).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import queue
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvcanary.distributed import RanksOutOfStep
from kvcanary.engine.tp import RankCanaryHooks, build_rank_engine, rank_model_config
from kvcanary.errors import CanaryViolation, ConfigError
from kvcanary.runs.driver import Driver, Progress
from kvcanary.runs.report import RankSection, RunReport, merge_ranks
from kvcanary.runs.setup import OptionError, RunSetup
from kvcanary.runs.single import RunOutcome, instrument, report
from kvcanary.runtime.canary import WatchdogTimeout

if TYPE_CHECKING:
    from kvcanary.faults.base import Fault

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


def run_rank_job(job: RankJob, progress: Progress | None = None) -> RunReport:
    """Run ``job`` on this rank (the process group is initialised); returns the rank's report."""
    rank, world = dist.get_rank(), dist.get_world_size()
    setup = job.setup
    if setup.engine.device.startswith("cuda"):
        setup = dataclasses.replace(setup, engine=dataclasses.replace(setup.engine, device=f"cuda:{rank}"))
    fault_rank = job.fault_rank % world
    built = instrument(lambda h: build_rank_engine(setup.model, setup.engine, h), RankCanaryHooks(setup.canary),
                       job.faults if rank == fault_rank else ())
    engine, hooks = built.engine, built.hooks
    driver, error, stopped_with, t0 = Driver(engine, setup.workload), None, [], time.perf_counter()
    try:
        driver.run(progress)
        hooks.finish()
    except STOPPING as e:  # on every rank in the same step: the agreement applies the policy in lock-step
        hooks.agreement.drain()
        error, stopped_with = f"rank {rank}: {e}", getattr(e, "violations", [])
    wall = time.perf_counter() - t0
    violations = built.collect()
    reported = {id(v) for v in violations}
    violations += [v for v in stopped_with if id(v) not in reported]  # those of the step that stopped the run
    counts = driver.counts()
    out = report(setup, RunOutcome(engine, hooks, counts, violations, built.injections, wall, error, built.alarms()))
    agreement = hooks.agreement
    divergences = agreement.divergences
    out.canary = out.canary.with_divergences(len(divergences), agreement.seconds)
    out.rank = RankSection(rank, world, [d.to_json() for d in divergences],
                           [{"step": step, "requests": list(rec.requests), "slots": list(rec.slots),
                             "since_step": rec.since_step} for step, rec in hooks.recoveries],
                           [engine.output_ids(i) for i in counts.request_ids] if job.keep_outputs else None)
    return out


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


def _rank_of(report: RunReport | dict) -> int:
    return report.rank.rank if isinstance(report, RunReport) else report["rank"]


def spawn_ranks(world: int, jobs: Sequence[RankJob], progress: Callable[[str, int, int], None] | None = None,
                threads: int = 1, target: Callable = _rank_main) -> dict[str, list[RunReport]]:
    """Run ``jobs`` in order on ``world`` local ranks, one process each; returns job name -> the
    ranks' reports in rank order. Raises the first rank's exception if a rank fails. ``target``:
    the processes' entry point (``_rank_main``'s signature; it sends ``("report", name, report)``
    with ``report.rank`` set, or a dict with ``report["rank"]``, for every job)."""
    results = mp.get_context("spawn").Queue()
    level = logging.getLogger("kvcanary").getEffectiveLevel()
    ctx = mp.spawn(target, args=(world, free_port(), list(jobs), results, level, threads), nprocs=world,
                   join=False)
    reports: dict[str, list[RunReport]] = {job.name: [] for job in jobs}

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
    return {name: sorted(rs, key=_rank_of) for name, rs in reports.items()}


def check_ranks(setup: RunSetup, tp: int) -> None:
    """Clear errors before any process starts."""
    if setup.engine.device.startswith("cuda") and torch.cuda.device_count() < tp:
        raise OptionError(f"{tp} ranks need {tp} CUDA devices, found {torch.cuda.device_count()}", "--tp")
    try:
        rank_model_config(setup.model, tp)
    except ConfigError as e:
        raise OptionError(str(e), "--tp") from None


def run_tp(setup: RunSetup, tp: int, faults: Sequence[Fault] = (), progress: Progress | None = None) -> RunReport:
    """The workload on ``tp`` local ranks (``faults`` on the last); the merged report, ``ranks``
    the per-rank reports."""
    check_ranks(setup, tp)
    threads = max(1, torch.get_num_threads() // tp)
    job = RankJob("run", setup, tuple(faults))
    ranks = spawn_ranks(tp, [job], (lambda name, done, total: progress(done, total)) if progress else None,
                        threads)["run"]
    return merge_ranks(ranks)
