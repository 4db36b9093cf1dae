"""``Engine.prefix_cache_slots`` after each step of a reference-engine run (the runs a due sweep
takes), median µs a call on a warmed engine with the canary off.

    python benchmarks/bench_prefix_cache_slots.py [--requests 96] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench_engine import build, engine_options, workload


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    if args.requests < 1:
        raise SystemExit(f"--requests must be >= 1, got {args.requests}")
    torch.set_num_threads(1)
    engine, _ = build("off", args.device, engine_options(args.device == "cuda"))
    engine.generate(workload(512, args.requests, seed=1000), 32)  # warmed: the prefix cache filled
    for p in workload(512, args.requests, seed=1):
        engine.add_request(p, 32)
    times, runs = [], []
    while engine.has_unfinished:
        engine.step()
        t0 = time.perf_counter()
        runs = engine.prefix_cache_slots()
        times.append(time.perf_counter() - t0)
    print(f"prefix_cache_slots: median {1e6 * statistics.median(times):.1f} µs a call over {len(times)} steps; "
          f"{len(runs)} idle runs at the end, {sum(1 for _ in engine.tree.nodes())} nodes")


if __name__ == "__main__":
    main()
