"""How a CUDA sweep's entries and held slots reach the device: host µs of each way (median of 300
calls in a loop), host µs of one call queued behind a long device sleep (a way that waits for the
stream shows the sleep), and device µs per copy (50 back to back between events).

    python3 benchmarks/bench_sweep_copy.py          # CUDA only

Sweep entries, ``n`` = 2000 of a plan of 65,536 (the default ``plan_capacity``):
- ``strided``: the [5, n] slice of the plan's column block from the [6, capacity] pinned rows
  (what ``Canary._load_sweep_plan`` did): torch stages a strided copy through temporaries;
- ``rows5``: five row copies, one per column;
- ``small_full``: a whole [6, 7281] block, contiguous (a plan sized to one sweep's budget);
- ``prefix``: the block's contiguous prefix up to the fifth column's ``n`` entries;
- ``packed``: the five columns packed into ``5n`` pinned words, one contiguous copy into device
  words, then spread into the columns on the device (what ``_load_sweep_plan`` does now).
Held slots, ``n`` int64 (``Canary.hold``): ``hold_pageable`` (``.to(device)`` from pageable
memory, as before), ``hold_pinned`` (through pinned words kept by the caller) and
``hold_pin_memory`` (pinned by torch's caching host allocator, then copied: as now).
Each way's result is compared with its source ("correct").
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench_sweep_copy.py needs CUDA")
    cap, n = 65536, 2000
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    staging = torch.randint(0, 1000, (6, cap), dtype=torch.int32, generator=gen).pin_memory()
    block = torch.zeros((6, cap), dtype=torch.int32, device=dev)
    small_st = torch.randint(0, 1000, (6, 7281), dtype=torch.int32, generator=gen).pin_memory()
    small = torch.zeros((6, 7281), dtype=torch.int32, device=dev)
    staging5 = torch.randint(0, 1000, (5 * cap,), dtype=torch.int32, generator=gen).pin_memory()
    landing = torch.empty(5 * cap, dtype=torch.int32, device=dev)
    held_cpu = torch.randperm(100_000, generator=gen)[:n].to(torch.int64)
    held_pin = torch.empty(4096, dtype=torch.int64).pin_memory()
    held_dev = torch.empty(4096, dtype=torch.int64, device=dev)

    def packed():
        landing[: 5 * n].copy_(staging5[: 5 * n], non_blocking=True)
        block[:5, :n].copy_(landing[: 5 * n].view(5, n))

    def rows5():
        for i in range(5):
            block[i, :n].copy_(staging[i, :n], non_blocking=True)

    def hold_pinned():
        held_pin[:n].copy_(held_cpu)
        held_dev[:n].copy_(held_pin[:n], non_blocking=True)

    ways = {
        "strided": (lambda: block[:, :n].copy_(staging[:, :n], non_blocking=True),
                    lambda: torch.equal(block[:, :n].cpu(), staging[:, :n])),
        "rows5": (rows5, lambda: torch.equal(block[:5, :n].cpu(), staging[:5, :n])),
        "small_full": (lambda: small.copy_(small_st, non_blocking=True), lambda: torch.equal(small.cpu(), small_st)),
        "prefix": (lambda: block.view(-1)[: 5 * cap + n].copy_(staging.view(-1)[: 5 * cap + n], non_blocking=True),
                   lambda: torch.equal(block[:5, :n].cpu(), staging[:5, :n])),
        "packed": (packed, lambda: torch.equal(block[:5, :n].cpu(), staging5[: 5 * n].view(5, n))),
        "hold_pageable": (lambda: held_cpu.to(dev, torch.int64).contiguous(), lambda: True),
        "hold_pinned": (hold_pinned, lambda: torch.equal(held_dev[:n].cpu(), held_cpu)),
        "hold_pin_memory": (lambda: held_cpu.pin_memory().to(dev, non_blocking=True),
                            lambda: torch.equal(held_cpu.pin_memory().to(dev, non_blocking=True).cpu(), held_cpu)),
    }
    print(f"{'way':14}{'host us':>10}{'host us behind a sleep':>24}{'device us':>11}  correct")
    for name, (f, check) in ways.items():
        for _ in range(20):
            f()
        torch.cuda.synchronize()
        ts = []
        for _ in range(300):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # ~50 ms of device time queued ahead of the call
        t = time.perf_counter()
        f()
        behind = time.perf_counter() - t
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(50):
            f()
        e1.record()
        torch.cuda.synchronize()
        print(f"{name:14}{statistics.median(ts) * 1e6:10.1f}{behind * 1e6:24.1f}{e0.elapsed_time(e1) * 1e3 / 50:11.1f}"
              f"  {check()}")


if __name__ == "__main__":
    main()
