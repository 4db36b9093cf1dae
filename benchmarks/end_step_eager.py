"""Host µs of an ``end_step`` that follows no graph replay (the path of every step of eager
forwards), in a loop: the step's snapshot (on CUDA since 3bd9e8e a publication launch; before,
a copy into a pinned row and an event record) and the read of the step before.

    PYTHONPATH=src python3 benchmarks/end_step_eager.py [--steps 2000] [--device cuda]

A canary (partial fingerprints of one K source) stamps three prefixes in one forward; then
``end_step`` runs alone, step after step, timed with the device idle (synchronised first) and
with it busy (a ~100 µs sleep kernel queued first, CUDA only). Prints the median and minimum µs
of the steps after the first quarter; every step must report zero violations and no device
flags. ``--device cpu`` runs the same loop on the CPU path (no publication there).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvcanary import Canary, CanaryConfig, ForwardBatch, Half, KVSource, PoolGeometry
from kvcanary.ops import FingerprintMode


def build(device: str, num_slots: int = 4096, ctx: int = 512, seed: int = 1) -> Canary:
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_slots, 2, 16, generator=gen).to(device, torch.bfloat16)
    # steps without forwards: a watchdog window longer than the loop keeps HEAD and TAIL from alarming
    config = CanaryConfig(real_kv=FingerprintMode.PARTIAL, max_bs=4, max_tokens=2048, sweep_interval=0,
                          watchdog_window=1 << 30)
    c = Canary(config, PoolGeometry(num_slots, 4, ctx, device), sources=[KVSource.from_buffer(kv, half=Half.K)])
    lens = torch.randint(200, ctx, (3,), generator=gen).tolist()
    perm = (torch.randperm(num_slots - 1, generator=gen) + 1).tolist()
    slots, tokens, at = [], [], 0
    for n in lens:
        slots.append(perm[at: at + n])
        tokens.append(torch.randint(0, 30_000, (n,), generator=gen).tolist())
        at += n
    table = torch.zeros(4, ctx, dtype=torch.int32)
    for r, s in enumerate(slots, start=1):
        table[r, : len(s)] = torch.tensor(s, dtype=torch.int32)
    i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    b = ForwardBatch(i64([1, 2, 3]), i64([0, 0, 0]), i64(lens), table.to(device), i64(sum(tokens, [])),
                     i64([p for n in lens for p in range(n)]), i64(sum(slots, [])))
    with c.forward(b):
        kv[b.out_cache_loc] = torch.randn(b.out_cache_loc.numel(), 2, 16, generator=gen).to(device, torch.bfloat16)
    c.end_step(0)
    return c


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    c = build(args.device)
    step = 1
    for busy in (False, True) if cuda else (False,):
        times = []
        for _ in range(args.steps):
            if cuda:
                torch.cuda.synchronize()
                if busy:
                    torch.cuda._sleep(200_000)  # the device busy for ~100 µs while end_step runs
            t = time.perf_counter()
            report = c.end_step(step)
            times.append(time.perf_counter() - t)
            if report.violations or report.device_flags:
                raise SystemExit(f"step {step}: {len(report.violations)} violations, flags {report.device_flags}")
            step += 1
        times = times[len(times) // 4:]
        print(f"device {'busy' if busy else 'idle'}: end_step without a replay, "
              f"median {statistics.median(times) * 1e6:.1f} µs, min {min(times) * 1e6:.1f} µs")
    pub = c.reporter.publication
    print(f"publishing: {c.publishing}; fallbacks: {pub.fallbacks if pub is not None else '-'}")


if __name__ == "__main__":
    main()
