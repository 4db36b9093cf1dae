"""Where a CPU canary's per-step time goes on `kv-canary run`'s workload (``bench_cpu_share.py``).

    PYTHONPATH=src python3 benchmarks/cpu_check_calls.py [--model tiny|small]

Two tables:
1. Each of ``launch_head``, ``tail``, ``end_step`` and ``prepare_head``, timed in the engine with
   its compiled call (``BoundForward``'s numba kernel) timed inside it: the medians of the
   call, of its compiled call and of the rest (the Python around it).
2. TAIL's compiled call of the run's 75th step repeated right after it ran (warm caches, the
   records as that TAIL found them: a clean batch, checked to add no violation), with and without
   the K/V fingerprints, at a quarter, a half and all of each request's prefix: the slope is the
   cost of one prefix entry of the page-table walk.
"""

from __future__ import annotations

import pathlib
import runpy
import statistics
import sys
import time

import numpy as np

import kvcanary.runtime.canary as canary_module
from kvcanary.ops.backend import BoundForward

CALLS = ("launch_head", "tail", "end_step", "prepare_head")


def main() -> None:
    compiled = {"s": 0.0}
    tails: list[int] = []
    warm_rows: list[tuple[int, float, float]] = []
    original = BoundForward.check

    def warm(bound, arrays, tag, truth) -> float:
        for _ in range(3):
            original(bound, arrays, None, tag, False, truth)
        ts = []
        for _ in range(40):
            t = time.perf_counter()
            original(bound, arrays, None, tag, False, truth)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e6

    def repeat_tail(bound, arrays, tag, truth) -> None:
        counter = bound.state_arrays[2]
        before = int(counter[0])
        for share in (0.25, 0.5, 1.0):
            rpi, prefix, *rest = arrays
            cut = (rpi, (prefix * share).astype(np.int64), *rest)
            with_fp = warm(bound, cut, tag, truth)
            sources, bound.num_sources = bound.num_sources, 0
            bare = warm(bound, cut, tag, truth)
            bound.num_sources = sources
            warm_rows.append((int(cut[1].sum()), with_fp, bare))
        if int(counter[0]) != before:
            sys.exit("the repeated TAIL reported violations: its figures would time the reporting, not the walk")

    def check(self, batch, held, tag, stamp, truth, scatter=None):
        inner = self._check

        def timed(*a):
            t = time.perf_counter()
            try:
                return inner(*a)
            finally:
                compiled["s"] += time.perf_counter() - t
        self._check = timed
        try:
            done = original(self, batch, held, tag, stamp, truth, scatter)
        finally:
            self._check = inner
        if not stamp and done:
            tails.append(1)
            if len(tails) == 75:
                t = time.perf_counter()
                repeat_tail(self, batch, tag, truth)
                compiled["s"] += time.perf_counter() - t  # the repeats are not this TAIL's Python
        return done

    BoundForward.check = check
    per_call: dict[str, list[tuple[float, float]]] = {n: [] for n in CALLS}

    def timing(f, name):
        def wrapped(self, b, *a):
            compiled["s"] = 0.0
            t = time.perf_counter()
            out = f(self, b, *a)
            per_call[name].append((time.perf_counter() - t, compiled["s"]))
            return out
        return wrapped

    for name in CALLS:
        setattr(canary_module.Canary, name, timing(getattr(canary_module.Canary, name), name))
    sys.argv = ["bench_cpu_share.py", *sys.argv[1:]]
    try:
        runpy.run_path(str(pathlib.Path(__file__).with_name("bench_cpu_share.py")), run_name="__main__")
    except SystemExit:  # its exit status: the run's report is what is wanted here
        pass
    BoundForward.check = original
    print(f"\n{'call':14s} {'n':>5s} {'µs a call':>10s} {'compiled':>9s} {'outside':>8s} {'outside, ms a run':>18s}")
    for name, rows in per_call.items():
        med = lambda xs: statistics.median(xs) * 1e6  # noqa: E731
        print(f"{name:14s} {len(rows):5d} {med([d for d, _ in rows]):10.1f} {med([k for _, k in rows]):9.1f} "
              f"{med([d - k for d, k in rows]):8.1f} {sum(d - k for d, k in rows) * 1e3:18.2f}")

    print(f"\n{'TAIL, warm':14s} {'entries':>8s} {'µs':>7s} {'µs, no fingerprints':>20s}")
    for entries, with_fp, bare in warm_rows:
        print(f"{'':14s} {entries:8d} {with_fp:7.1f} {bare:20.1f}")


if __name__ == "__main__":
    main()
