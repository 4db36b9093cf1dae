"""Per-step cost of the tensor-parallel agreement on 2 ranks, and the clean and fault runs.

    PYTHONPATH=src python3 benchmarks/bench_distributed.py [--device cuda|cpu] [--json PATH]

Needs 2 CUDA devices (NCCL) with ``--device cuda``; ``--device cpu`` runs the same on gloo.
The agreement's cost per batch size and policy, with the signal captured in CUDA graphs and
under torchrun: ``bench_agreement.py``.

Part 1, the agreement's cost. Each rank holds a canary of a 1M-slot pool and a decode batch of
``bs`` requests. A synthetic tensor-parallel forward (per layer: a column- and a row-parallel
matmul of the hidden state and an all-reduce of it over the ranks) runs in two modes, interleaved
in blocks of steps: ``base`` = forward + ``Canary.end_step``; ``agreed`` = ``RankAgreement.launch``
+ forward + ``RankAgreement.end_step`` (which runs ``Canary.end_step`` too). The difference of
the median step times is the per-step cost of the agreement: the ring summary and chain digest
kernels, the asynchronous all-reduce of the signal table, its copy to the host and the read
one step later. Also reported: host µs inside ``launch`` / ``end_step``, and the device µs of
the agreement's kernels on the compute stream (CUDA events around ``launch``).

Part 2, the runs: the built-in workload on 2 ranks (small model, greedy): clean; a page-table
entry repointed on rank 1 only, under log and under recompute. Per run: violations per rank, the
step each rank first reported the ``rank_divergence``, steps from the injection, recomputes, and
whether every request's output equals the clean run's.

Prints a short table last and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from kvcanary.config import CanaryConfig, Policy
from kvcanary.distributed import RankAgreement
from kvcanary.engine.config import SamplerKind
from kvcanary.engine.workload import WorkloadConfig, builtin_workload, engine_config_for
from kvcanary.faults import PageTableRepoint
from kvcanary.runs.setup import MODELS, ModelPreset, RunSetup
from kvcanary.runs.tp import RankJob, init_rank, spawn_ranks
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.canary import Canary, PoolGeometry


@dataclasses.dataclass(frozen=True)
class CostJob:
    name: str
    device: str
    batch_sizes: tuple[int, ...]
    hidden: int
    layers: int
    steps: int
    blocks: int


def decode_batch(bs: int, num_slots: int, prefix: int, device: torch.device, gen: torch.Generator) -> ForwardBatch:
    rows = torch.arange(1, bs + 1)
    table = torch.zeros(bs + 1, prefix + 1, dtype=torch.int32)
    table[1:] = torch.randperm(num_slots - 1, generator=gen)[: bs * (prefix + 1)].view(bs, prefix + 1).int() + 1
    return ForwardBatch(rows.to(device), torch.full((bs,), prefix, device=device), torch.ones(bs, dtype=torch.int64,
                        device=device), table.to(device), torch.randint(0, 32000, (bs,), generator=gen).to(device),
                        torch.full((bs,), prefix, device=device), table[1:, prefix].long().to(device))


def agreement_cost(job: CostJob, rank: int) -> dict:
    device = torch.device(f"cuda:{rank}" if job.device == "cuda" else "cpu")
    is_cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if is_cuda else (lambda: None)
    dtype = torch.bfloat16 if is_cuda else torch.float32
    gen = torch.Generator().manual_seed(rank)
    world = dist.get_world_size()
    out = []
    for bs in job.batch_sizes:
        config = CanaryConfig(policy=Policy.LOG, sweep_interval=0, watchdog_window=1 << 30)  # no HEAD runs here
        canary = Canary(config, PoolGeometry(1 << 20, bs + 1, 256, str(device)))
        agreement = RankAgreement(canary, Policy.LOG)
        batch = decode_batch(bs, 1 << 20, 200, device, gen)
        w_in = torch.randn(job.hidden, job.hidden // world, generator=gen).to(device, dtype) * 0.01
        w_out = torch.randn(job.hidden // world, job.hidden, generator=gen).to(device, dtype) * 0.01
        x0 = torch.randn(bs, job.hidden, generator=gen).to(device, dtype)

        def forward(x=x0, w_in=w_in, w_out=w_out) -> None:
            for _ in range(job.layers):
                y = (x @ w_in) @ w_out
                dist.all_reduce(y)
                x = x + y

        times = {"base": [], "agreed": []}
        host_launch, host_end, device_launch = [], [], []
        step = 0
        for block in range(job.blocks + 1):  # block 0 warms up
            for mode in ("base", "agreed"):
                sync()
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(job.steps):
                    if mode == "agreed":
                        e0 = e1 = None
                        if is_cuda:
                            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            e0.record()
                        h0 = time.perf_counter()
                        agreement.launch(step, batch)
                        host_launch.append(time.perf_counter() - h0)
                        if is_cuda:
                            e1.record()
                            device_launch.append((e0, e1))
                        forward()
                        h0 = time.perf_counter()
                        agreement.end_step(step)
                        host_end.append(time.perf_counter() - h0)
                    else:
                        forward()
                        canary.end_step(step)
                    step += 1
                sync()
                if block:
                    times[mode].append((time.perf_counter() - t0) / job.steps)
        agreement.finish(step)
        sync()
        base, agreed = statistics.median(times["base"]), statistics.median(times["agreed"])
        dev_us = [a.elapsed_time(b) * 1e3 for a, b in device_launch[job.steps:]] if is_cuda else []
        out.append({"bs": bs, "base_us": base * 1e6, "agreed_us": agreed * 1e6, "cost_us": (agreed - base) * 1e6,
                    "cost_pct": 100 * (agreed - base) / base,
                    "launch_host_us": statistics.median(host_launch[job.steps:]) * 1e6,
                    "end_step_host_us": statistics.median(host_end[job.steps:]) * 1e6,
                    "launch_device_us": statistics.median(dev_us) if dev_us else None,
                    "base_blocks_us": [t * 1e6 for t in times["base"]],
                    "agreed_blocks_us": [t * 1e6 for t in times["agreed"]]})
    return {"rank": rank, "cost": out}


def cost_main(rank: int, world: int, port: int, jobs, results, log_level: int, threads: int) -> None:
    torch.set_num_threads(threads)
    init_rank(rank, world, port, jobs[0].device)
    try:
        for job in jobs:
            results.put(("report", job.name, agreement_cost(job, rank)))
    finally:
        dist.destroy_process_group()


def run_jobs(device: str, requests: int) -> list[RankJob]:
    model = dataclasses.replace(MODELS[ModelPreset.SMALL], seed=0)
    workload = builtin_workload(WorkloadConfig(num_requests=requests, max_new_tokens=16, vocab_size=model.vocab_size))
    engine = engine_config_for(workload, device, sampler=SamplerKind.GREEDY)
    setup = lambda policy: RunSetup(model, engine, CanaryConfig(policy=policy, sweep_interval=8), workload)
    fault = lambda: (PageTableRepoint(seed=0, warmup_steps=24),)
    return [RankJob("clean", setup(Policy.LOG), keep_outputs=True),
            RankJob("fault_log", setup(Policy.LOG), fault(), fault_rank=1),
            RankJob("fault_recompute", setup(Policy.RECOMPUTE), fault(), fault_rank=1, keep_outputs=True)]


def summarise_run(name: str, ranks: list[dict], clean: list[dict] | None) -> dict:
    injections = [i for r in ranks for i in r["injections"]]
    step = injections[0]["step"] if injections else None
    first = [min((d["step"] for d in r["rank_divergences"]), default=None) for r in ranks]
    return {"run": name, "steps": ranks[0]["steps"], "injection_step": step,
            "violations_per_rank": [r["violations"] for r in ranks],
            "local_violations_per_rank": [r["violations_decoded"] for r in ranks],
            "first_divergence_step_per_rank": first,
            "steps_to_report_per_rank": [f - step if f is not None and step is not None else None for f in first],
            "recomputes_per_rank": [r["engine"]["num_recomputes"] for r in ranks],
            "outputs_equal_clean": (all(r["outputs"] == c["outputs"] for r, c in zip(ranks, clean, strict=True))
                                    if clean and "outputs" in ranks[0] else None),
            "canary_time_share_per_rank": [r["canary_time_share"] for r in ranks],
            "wall_seconds": max(r["wall_seconds"] for r in ranks), "stopped": [r["stopped"] for r in ranks]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=50, help="steps per timed block")
    ap.add_argument("--blocks", type=int, default=10, help="timed blocks per mode (interleaved)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--json", default=os.path.join(os.environ["OUT"], "bench_distributed.json") if "OUT" in os.environ
                    else "bench_distributed.json")
    args = ap.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit(f"--device cuda needs 2 CUDA devices, found {torch.cuda.device_count()}")
    cost = CostJob("cost", args.device, tuple(int(b) for b in args.batch_sizes.split(",")), args.hidden, args.layers,
                   args.steps, args.blocks)
    threads = 1 if args.device == "cpu" else 4
    cost_ranks = spawn_ranks(2, [cost], threads=threads, target=cost_main)["cost"]
    runs = {name: [r.to_json() for r in ranks]
            for name, ranks in spawn_ranks(2, run_jobs(args.device, args.requests), threads=threads).items()}
    summary = [summarise_run(name, ranks, runs["clean"]) for name, ranks in runs.items()]
    env = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "torch": torch.__version__,
           "backend": "nccl" if args.device == "cuda" else "gloo", "world": 2}
    result = {"environment": env, "args": vars(args), "agreement_cost": cost_ranks, "runs": summary,
              "run_reports": {name: [{k: v for k, v in r.items() if k != "outputs"} for r in ranks]
                              for name, ranks in runs.items()}}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\n{env['device']} x2, {env['backend']}, torch {env['torch']}; JSON: {args.json}")
    print("\nagreement per step (rank 0; synthetic TP forward "
          f"{args.layers} layers x hidden {args.hidden}, median of {args.blocks} blocks of {args.steps} steps)")
    print(f"{'bs':>5} {'base us':>10} {'agreed us':>10} {'cost us':>9} {'cost %':>7} {'launch host':>12} "
          f"{'end host':>9} {'launch dev':>11}")
    for c in cost_ranks[0]["cost"]:
        dev = f"{c['launch_device_us']:.1f}" if c["launch_device_us"] is not None else "-"
        print(f"{c['bs']:>5} {c['base_us']:>10.1f} {c['agreed_us']:>10.1f} {c['cost_us']:>9.1f} {c['cost_pct']:>6.1f}% "
              f"{c['launch_host_us']:>12.1f} {c['end_step_host_us']:>9.1f} {dev:>11}")
    print("\nruns (2 ranks, fault on rank 1 only)")
    print(f"{'run':<16} {'steps':>5} {'inject':>6} {'violations/rank':>16} {'divergence at':>14} {'lag':>7} "
          f"{'recomputes':>10} {'= clean':>8}")
    for s in summary:
        lag = ",".join("-" if x is None else str(x) for x in s["steps_to_report_per_rank"])
        first = ",".join("-" if x is None else str(x) for x in s["first_divergence_step_per_rank"])
        print(f"{s['run']:<16} {s['steps']:>5} {str(s['injection_step']):>6} "
              f"{','.join(map(str, s['violations_per_rank'])):>16} {first:>14} {lag:>7} "
              f"{','.join(map(str, s['recomputes_per_rank'])):>10} {str(s['outputs_equal_clean']):>8}")


if __name__ == "__main__":
    main()
