"""Host µs of the parts of an eager HEAD replayed from a bucket graph (``CanaryConfig.eager_graphs``):
the layout check (``BoundCheck.takes``), ``DeviceState.check``, the copy of the batch into the
bucket (``EagerBuffers.load``), and the whole of ``EagerGraphs.head`` and ``Canary.launch_head``.

    PYTHONPATH=src python3 benchmarks/eager_graphs_head_parts.py [--device cuda] [--iters 200]
                                                                [--shapes 4x0x64,16x512x16]

The steps of ``eager_graphs_host.py`` (device busy), the graphs canary only; each part timed on
the host around its call; medians of the iterations after the first quarter. ``--device cpu``
(with ``TRITON_INTERPRET=1``) is a smoke run of the path: its timings say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import eager_graphs_host as host  # noqa: E402
from kvcanary.runtime import eager_graphs  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--shapes", default="4x0x64,16x512x16")
    args = ap.parse_args(argv)
    parts: dict[str, list[float]] = {}

    def timed(name, fn):
        def call(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            parts.setdefault(name, []).append(time.perf_counter() - t)
            return out
        return call

    eager_graphs.EagerBuffers.load = timed("EagerBuffers.load", eager_graphs.EagerBuffers.load)
    print("| shape | " + " | ".join(("takes", "state check", "load", "EagerGraphs.head", "launch_head")) + " |")
    print("|---|---:|---:|---:|---:|---:|")
    for bs, prefix, extend in host.parse_shapes(args.shapes):
        parts.clear()
        c, sb = host.build(args.device, bs, prefix, extend, graphs=True)
        eager = c._eager
        eager.head_check.takes = timed("takes", eager.head_check.takes)
        eager.check = timed("state check", eager.check)
        eager.head = timed("EagerGraphs.head", eager.head)
        c.launch_head = timed("launch_head", c.launch_head)
        for n in range(1, args.iters + 1):
            host.step(c, sb, n, True)
        med = {k: statistics.median(v[len(v) // 4:]) * 1e6 for k, v in parts.items()}
        names = ("takes", "state check", "EagerBuffers.load", "EagerGraphs.head", "launch_head")
        print(f"| {bs}x{prefix}x{extend} | " + " | ".join(f"{med[k]:.1f}" for k in names) + " |")


if __name__ == "__main__":
    main()
