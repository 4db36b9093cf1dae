"""Host µs of an ``end_step`` that follows no graph replay (the path of every step of eager
forwards), in a loop: the step's snapshot (on CUDA since 3bd9e8e a publication launch; before,
a copy into a pinned row and an event record) and the read of the step before.

    PYTHONPATH=src python3 benchmarks/end_step_eager.py [--steps 2000] [--device cuda]

A canary (partial fingerprints of one K source) stamps three prefixes in one forward; then
``end_step`` runs alone, step after step, timed with the device idle (synchronised first) and
with it busy (a ~100 µs sleep kernel queued first, CUDA only). Prints the median µs of the steps
after the first quarter and their range; every step must report zero violations and no device
flags. ``--device cpu`` runs the same loop on the CPU path (no publication there).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvcanary import Canary, CanaryConfig, Half, KVSource, PoolGeometry
from kvcanary.bench.floors import StepShape
from kvcanary.bench.step_parts import StepBatch, write_covered
from kvcanary.ops import FingerprintMode

PAGE = 16


def build(device: str, bs: int = 3, context: int = 512, seed: int = 1) -> Canary:
    """A canary whose ``bs`` prefixes of ``context`` tokens were stamped by one forward."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = bs * (context // PAGE + 2) + 1
    sb = StepBatch(StepShape("decode", bs, context, 1), pages, PAGE, device, gen, 30_000)
    num_slots = PAGE * pages
    kv = torch.randn(num_slots, 2, 16, generator=gen, device=device).to(torch.bfloat16)
    # steps without forwards: a watchdog window longer than the loop keeps HEAD and TAIL from alarming
    config = CanaryConfig(real_kv=FingerprintMode.PARTIAL, max_bs=bs + 1, max_tokens=bs * context, sweep_interval=0,
                          watchdog_window=1 << 30)
    source = KVSource.from_buffer(kv, half=Half.K)
    c = Canary(config, PoolGeometry(num_slots, bs + 1, sb.held, device), sources=[source])
    with c.forward(sb.fill):
        write_covered(c, sb.fill)
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
              f"median {statistics.median(times) * 1e6:.1f} µs [{min(times) * 1e6:.1f}-{max(times) * 1e6:.1f}]")
    pub = c.reporter.publication
    print(f"publishing: {c.publishing}; fallbacks: {pub.fallbacks if pub is not None else '-'}")


if __name__ == "__main__":
    main()
