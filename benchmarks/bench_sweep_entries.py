"""A sweep's host arrays from its runs, with and without a RunCache (CPU, wall µs medians).

    PYTHONPATH=src python3 benchmarks/bench_sweep_entries.py [--runs 20] [--slots 50] [--calls 300]

The runs are CPU slot tensors with token tuples, unchanged between calls: a prefix cache that
holds still between two sweeps, the case the cache is for. An engine whose runs are new at every
sweep pays the uncached figure plus the cache's own bookkeeping.
"""

from __future__ import annotations

import argparse
import random

import torch

from kvcanary.bench.timing import median_us
from kvcanary.runtime.sweep import RunCache, SweepRun, sweep_entries

CPU = torch.device("cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--slots", type=int, default=50)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    rng = random.Random(0)
    runs = [SweepRun(torch.tensor(rng.sample(range(1, 1 << 20), args.slots)),
                     tuple(rng.randrange(50_000) for _ in range(args.slots)), rng.randrange(4096), -1)
            for _ in range(args.runs)]
    cache = RunCache()
    budget = 1 << 20
    uncached = median_us(lambda: sweep_entries(runs, 5, budget), CPU, 1, args.calls)
    cached = median_us(lambda: sweep_entries(runs, 5, budget, cache), CPU, 1, args.calls)
    print(f"{args.runs} runs x {args.slots} slots: uncached {uncached:.1f} us, from the cache {cached:.1f} us")


if __name__ == "__main__":
    main()
