"""Where the canary's time goes in ``kv-canary run`` on the CPU: per Canary method, the wall time
(total, calls, median) and the CPU time of the calling thread (``time.thread_time``: what the
canary itself spent, without the time slices other processes took from it), then the canary's
share of ``Engine.step`` by both clocks, then the run's own report.

    PYTHONPATH=src python benchmarks/bench_cpu_share.py [run options, e.g. --model small]

On a shared machine the wall share moves by several points between runs (a 4 ms time slice lost
to another process lands in whatever is running); the CPU-time share moves far less, so it is the
figure to compare versions by. ``prepare_head``, ``launch_head``, ``tail``, ``sweep`` and
``end_step`` make up the report's "canary time share"; ``offload``, ``load_back`` and
``verify_landed`` (records following K/V to the host tier and back) are canary work outside that
figure, shown for completeness.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict

from kvcanary.cli import main
from kvcanary.engine import engine as engine_mod
from kvcanary.runtime import canary as canary_mod

METHODS = ("prepare_head", "launch_head", "tail", "sweep", "end_step", "offload", "load_back", "rows_landed",
           "verify_landed")
IN_SHARE = ("prepare_head", "launch_head", "tail", "sweep", "end_step")


def instrument(cls, names, times: dict[str, list[tuple[float, float]]]) -> None:
    for name in names:
        fn = getattr(cls, name)

        def timed(self, *args, _fn=fn, _name=name, **kwargs):
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return _fn(self, *args, **kwargs)
            finally:
                times[_name].append((time.perf_counter() - w0, time.thread_time() - c0))

        setattr(cls, name, timed)


def report(times: dict[str, list[tuple[float, float]]]) -> None:
    print(f"{'method':<14} {'wall ms':>8} {'cpu ms':>8} {'calls':>6} {'wall median us':>15} {'cpu median us':>14}",
          file=sys.stderr)
    for name in sorted((n for n in times if n != "step"), key=lambda n: -sum(w for w, _ in times[n])):
        v = times[name]
        print(f"{name:<14} {sum(w for w, _ in v) * 1e3:8.1f} {sum(c for _, c in v) * 1e3:8.1f} {len(v):6d} "
              f"{statistics.median(w for w, _ in v) * 1e6:15.1f} {statistics.median(c for _, c in v) * 1e6:14.1f}",
              file=sys.stderr)
    step = times.get("step", [])
    if step:
        for i, clock in enumerate(("wall", "cpu")):
            canary = sum(x[i] for n in IN_SHARE for x in times.get(n, []))
            total = sum(x[i] for x in step)
            print(f"canary share of Engine.step, {clock} clock: {canary / total:.1%} ({canary:.3f} s of {total:.3f} s)",
                  file=sys.stderr)


if __name__ == "__main__":
    times: dict[str, list[tuple[float, float]]] = defaultdict(list)
    instrument(canary_mod.Canary, METHODS, times)
    instrument(engine_mod.Engine, ("step",), times)
    sys.argv = ["kv-canary", "run", *sys.argv[1:]]
    try:
        main()
    finally:
        report(times)
