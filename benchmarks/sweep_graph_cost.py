"""Whether a CUDA graph can capture a sweep's plan load and verify, and what one replay costs.

    PYTHONPATH=src python3 benchmarks/sweep_graph_cost.py

The check made before ``runtime/sweep_graphs.py`` was written (torch 2.11 on the H200): captures,
by hand, a pinned-to-device copy of the staged words, their spread into the sweep plan's columns,
the count and the plan's bound verify, at five sizes from 256 entries to the plan's capacity;
checks that a replay lands 1000 staged entries and their count; then times the host work of a
load and verify of 1000 entries (the device idle before each call, median of 250 after 50) as
the four eager calls and as a replay with its event record, and the device time of a replay of
each size (50 back to back). CUDA only.
"""

from __future__ import annotations

import statistics
import time

import torch

from kvcanary import Canary, CanaryConfig
from kvcanary.core.record import LaunchPoint
from kvcanary.runtime.canary import PoolGeometry


def main() -> None:
    dev = torch.device("cuda")
    print("torch", torch.__version__)
    c = Canary(CanaryConfig(), PoolGeometry(num_slots=1 << 16, rows=64, max_ctx=4096, device="cuda"))
    p = c.sweep_plan
    cap = p.capacity
    block = c._sweep_block
    staging = torch.empty(5 * cap, dtype=torch.int32, pin_memory=True)
    landing = torch.empty(5 * cap, dtype=torch.int32, device=dev)
    count_h = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    tag = c.tag(LaunchPoint.SWEEP)
    graphs = {}
    for m in (256, 1024, 4096, 16384, cap):
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
            landing[: 5 * m].copy_(staging[: 5 * m], non_blocking=True)
            block[:5, :m].copy_(landing[: 5 * m].view(5, m))
            p.count.copy_(count_h, non_blocking=True)
            c._sweep_verify(tag)
        torch.cuda.current_stream(dev).wait_stream(s)
        graphs[m] = g
    print("captured", list(graphs))
    n = 1000  # staged entries: a replay lands them and their count
    h = staging.numpy()[: 5 * 1024].reshape(5, 1024)
    vals = torch.randint(0, 1 << 16, (5, n), dtype=torch.int32).numpy()
    h[:, :n] = vals
    count_h[0] = n
    ev = torch.cuda.Event()
    graphs[1024].replay()
    ev.record()
    ev.synchronize()
    print("block matches", bool((block[:5, :n].cpu().numpy() == vals).all()) and int(p.count) == n)

    def eager():
        landing[: 5 * n].copy_(staging[: 5 * n], non_blocking=True)
        block[:5, :n].copy_(landing[: 5 * n].view(5, n))
        p.count.fill_(n)
        c._sweep_verify(tag)
        ev.record()

    def graph():
        graphs[1024].replay()
        ev.record()

    for f, name in ((eager, "eager"), (graph, "graph")):
        ts = []
        for _ in range(300):
            torch.cuda.synchronize()
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        print(name, "host us median", round(statistics.median(ts[50:]) * 1e6, 1))
    for m, g in graphs.items():  # device time of a replay of each size
        s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s0.record()
        for _ in range(50):
            g.replay()
        s1.record()
        s1.synchronize()
        print("class", m, "device us per replay", round(s0.elapsed_time(s1) * 1000 / 50, 1))


if __name__ == "__main__":
    main()
