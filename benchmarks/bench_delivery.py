"""Host cost per step of the reference engine's delivery bookkeeping with a report lag (CUDA's 1).

    PYTHONPATH=src python3 benchmarks/bench_delivery.py [--requests 24] [--steps 400]

Per step, ``--requests`` requests sample a token each while holding 60-124 slots (the
`bench_engine.py` workload's sizes); the engine hands ``Delivery.sampled`` each request's slot
tensor and then advances delivery by one step, as ``Engine.step`` does. Printed: the median µs a
step of that, and of the conversion the bookkeeping made before it kept the tensors as they are
(a clone and a Python set of each request's slots, every step).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvcanary.engine.delivery import Delivery
from kvcanary.engine.request import Request


def median_us(f, steps: int) -> float:
    ts = []
    for i in range(steps):
        t = time.perf_counter()
        f(i)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    reqs = [Request(i, [1, 2, 3], 10 ** 6) for i in range(args.requests)]
    for r in reqs:
        r.slots = torch.randint(1, 4000, (int(torch.randint(60, 125, (1,), generator=gen)),), generator=gen)
    delivery = Delivery(lag=1)

    def now(step: int) -> None:
        held = {r.request_id: r.slots for r in reqs}
        for r in reqs:
            r.output_ids.append(step)
            r.output_steps.append(step)
            delivery.sampled(r, held.get(r.request_id), step)
        delivery.advance(step)

    def conversion(step: int) -> None:
        [set(r.slots.clone().tolist()) for r in reqs]

    kept, converted = median_us(now, args.steps), median_us(conversion, args.steps)
    print(f"{args.requests} requests a step, {args.steps} steps: delivery bookkeeping {kept:.1f} µs a step; "
          f"the conversion it no longer makes {converted:.1f} µs a step")


if __name__ == "__main__":
    main()
