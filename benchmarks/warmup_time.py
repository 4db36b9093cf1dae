"""Building a canary on CUDA: the warm-up's time, and the sweep graphs' capture inside it.

    PYTHONPATH=src python3 benchmarks/warmup_time.py [--rounds 3]

Builds a canary of 65536 slots (real-KV none, then partial over one bf16 K source) ``--rounds``
times in one process: the first round compiles every kernel variant (a fresh Triton cache
compiles; a warm one loads), later rounds find them compiled. Prints per build its wall time,
``Canary.warmup_seconds`` and the capture of the sweep's graphs (``runtime.sweep_graphs``), all
synchronised. CUDA only.
"""

from __future__ import annotations

import argparse
import time

import torch

import kvcanary.runtime.sweep_graphs as sweep_graphs
from kvcanary import Canary, CanaryConfig
from kvcanary.ops.fingerprint import FingerprintMode, KVSource
from kvcanary.runtime.canary import PoolGeometry

SLOTS = 1 << 16


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("warmup_time.py needs CUDA")
    kv = torch.randn(SLOTS, 2, 8, 128, device="cuda").to(torch.bfloat16)
    captures = []
    build = sweep_graphs.SweepGraphs.__init__

    def timed(self, *a, **k):
        t = time.perf_counter()
        build(self, *a, **k)
        torch.cuda.synchronize()
        captures.append(time.perf_counter() - t)

    sweep_graphs.SweepGraphs.__init__ = timed
    for i in range(args.rounds):
        for mode in (FingerprintMode.NONE, FingerprintMode.PARTIAL):
            t = time.perf_counter()
            c = Canary(CanaryConfig(real_kv=mode), PoolGeometry(SLOTS, 256, 4096, "cuda"),
                       sources=[KVSource.from_buffer(kv)])
            torch.cuda.synchronize()
            print(f"round {i} {mode.name:8} build {time.perf_counter() - t:.3f} s warm-up {c.warmup_seconds:.3f} s "
                  f"sweep graphs {captures[-1] * 1e3:.1f} ms ({len(c._sweep_graphs.graphs)} classes)")


if __name__ == "__main__":
    main()
