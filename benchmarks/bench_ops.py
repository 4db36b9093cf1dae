"""Cross-check and time the canary ops (scatter, gather, build_plan, stamp, verify, fingerprint).

The logic lives in ``kvcanary.bench.ops`` (shared with ``kv-canary bench ops``); see its doc for
what is compared, how it is timed and the floors. Without CUDA the Triton kernels run under
``TRITON_INTERPRET=1`` (set here, before the first triton import) at tiny shapes.

    python benchmarks/bench_ops.py                    # full run on CUDA
    python benchmarks/bench_ops.py --check-only       # correctness only
    TRITON_INTERPRET=1 python benchmarks/bench_ops.py --quick   # CPU smoke run, tiny shapes
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import (kvcanary.ops imports it)

from kvcanary.bench.op_cases import run_ops  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (implied without CUDA)")
    p.add_argument("--check-only", action="store_true", help="correctness only, no timing")
    p.add_argument("--json", default=None, help="write details here (default $OUT/bench_ops.json when OUT is set)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=float, default=400, help="seconds after which timing stops (checks go on)")
    args = p.parse_args(argv)
    json_path = args.json or (os.path.join(os.environ["OUT"], "bench_ops.json") if os.environ.get("OUT") else None)
    data = run_ops(torch.device("cuda" if CUDA else "cpu"), quick=args.quick or not CUDA, json_path=json_path,
                   check_only=args.check_only, seed=args.seed, budget_s=args.budget)
    return 0 if data["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
