"""Where the canary's wall time goes in ``kv-canary run`` on the CPU: per Canary method, the total,
the calls, the mean and the median (the median is the useful one on a shared machine: a process
preempted for a 4 ms time slice inflates whatever method it was in), then the run's own report.

    PYTHONPATH=src python benchmarks/bench_cpu_share.py [run options, e.g. --model small]

``prepare_head``, ``launch_head``, ``tail``, ``sweep`` and ``end_step`` make up the report's
"canary time share"; ``offload``, ``load_back`` and ``verify_landed`` (records following K/V to
the host tier and back) are canary work outside that figure, shown for completeness.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict

from kvcanary.cli import main
from kvcanary.runtime import canary as canary_mod

METHODS = ("prepare_head", "launch_head", "tail", "sweep", "end_step", "offload", "load_back", "verify_landed")


def instrument(times: dict[str, list[float]]) -> None:
    for name in METHODS:
        fn = getattr(canary_mod.Canary, name)

        def timed(self, *args, _fn=fn, _name=name, **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(self, *args, **kwargs)
            finally:
                times[_name].append(time.perf_counter() - t0)

        setattr(canary_mod.Canary, name, timed)


def report(times: dict[str, list[float]]) -> None:
    print(f"{'method':<14} {'total ms':>9} {'calls':>6} {'mean us':>9} {'median us':>10}", file=sys.stderr)
    for name in sorted(times, key=lambda n: -sum(times[n])):
        v = times[name]
        print(f"{name:<14} {sum(v) * 1e3:9.1f} {len(v):6d} {sum(v) / len(v) * 1e6:9.1f} "
              f"{statistics.median(v) * 1e6:10.1f}", file=sys.stderr)


if __name__ == "__main__":
    times: dict[str, list[float]] = defaultdict(list)
    instrument(times)
    sys.argv = ["kv-canary", "run", *sys.argv[1:]]
    try:
        main()
    finally:
        report(times)
