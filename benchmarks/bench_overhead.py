"""The overhead study: the canary's device time per step over the bandwidth floor of the step.

The logic lives in ``kvcanary.bench.overhead`` (shared with ``kv-canary bench overhead``).

    python benchmarks/bench_overhead.py --json overhead.json --markdown overhead.md   # H200: the study
    python benchmarks/bench_overhead.py --quick                                       # CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from kvcanary.bench.overhead import MODES, markdown_table, run_overhead


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes that run in seconds on the CPU")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None,
                   help="write details here (default $OUT/bench_overhead.json when OUT is set)")
    p.add_argument("--markdown", default=None, help="write the table as Markdown here")
    p.add_argument("--modes", default=None, help=f"comma-separated subset of {','.join(m.name for m in MODES)}")
    p.add_argument("--sweep-budget", type=int, default=1 << 20, help="bytes one sweep may read")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    json_path = args.json or (os.path.join(os.environ["OUT"], "bench_overhead.json") if os.environ.get("OUT")
                              else None)
    modes = tuple(args.modes.split(",")) if args.modes else None
    data = run_overhead(torch.device(args.device), quick=args.quick, json_path=json_path, seed=args.seed, modes=modes,
                        sweep_budget=args.sweep_budget)
    if args.markdown:
        Path(args.markdown).write_text(markdown_table(data))
    return 0 if data["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
