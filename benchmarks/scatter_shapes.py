"""The token-truth scatter at the shapes a served engine launches, beyond ``bench_ops``' five.

    PYTHONPATH=src python3 benchmarks/scatter_shapes.py [LABEL]

Many short requests (16384 x 64, 4096 x 256, 1024 x 256), decode appends of one token a request
at a column of their own (256 x 1, 1024 x 1: ``ForwardBatch.truth_starts``) and one long shape
(256 x 8192), each through ``scatter_validated`` with the launch shape the sizes pick. Inputs are
rotated over enough sets to leave the L2 cache (as ``bench_ops``); prints, per shape, the median
of three graph-replay medians (µs), their range, the bandwidth floor (12 bytes a token: an int64
read, an int32 written) and the ratio. Needs CUDA.
"""

from __future__ import annotations

import math
import statistics
import sys

import torch

from kvcanary.bench import timing
from kvcanary.ops.scatter import scatter_validated

SHAPES = ((16384, 64, False), (4096, 256, False), (1024, 256, False), (256, 1, True), (1024, 1, True),
          (256, 8192, False))
L2_BYTES = 60e6


def main(argv: list[str]) -> None:
    if not torch.cuda.is_available():
        sys.exit("scatter_shapes.py needs CUDA")
    dev = torch.device("cuda")
    bw = timing.copy_bandwidth(dev, 1 << 30)
    print(argv[0] if argv else "scatter")
    for bs, seg, append in SHAPES:
        n = bs * seg
        nbytes = 12 * n + 16 * bs + 8
        width = max(seg, 64) * (2 if append else 1)
        sets = []
        for _ in range(1 if nbytes >= L2_BYTES else min(128, math.ceil(2 * L2_BYTES / nbytes))):
            sets.append((torch.randint(0, 1 << 30, (n,), device=dev), torch.arange(0, bs + 1, device=dev) * seg,
                         torch.randperm(bs, device=dev),
                         torch.randint(0, 1 << 30, (bs + 1, width), device=dev, dtype=torch.int32),
                         torch.zeros(1, dtype=torch.int32, device=dev),
                         torch.randint(0, width - seg, (bs,), device=dev) if append else None))
        fns = [lambda s=s: scatter_validated(s[0], s[1], s[2], s[3], s[4], None, True, s[5]) for s in sets]
        us = [timing.graph_us(fns) for _ in range(3)]
        floor = timing.floor_us(nbytes, bw)
        med = statistics.median(us)
        print(f"  {bs}x{seg}{' append' if append else ''}: {med:.2f} us [{min(us):.2f}-{max(us):.2f}] "
              f"floor {floor:.2f} ratio {med / floor:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
