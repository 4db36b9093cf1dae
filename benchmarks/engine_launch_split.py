"""What one of the canary's direct Triton launches costs inside the warmed reference engine, split
into the launcher's own Python (keying the arguments), Triton's launcher object and the driver call.

    PYTHONPATH=src python3 benchmarks/engine_launch_split.py      # CUDA only

Builds the ``bench_engine.py`` engine with a partial canary (graph-captured decode), warms it up
with two runs, then wraps each kept compiled kernel of ``kvcanary.ops.launcher``: ``kernel.run``
(Triton's launcher object) and its ``launch`` (the C call that reaches the driver), and the ops'
``launch`` itself, and times three runs of eager calls (a graph replay launches none of them).
Also counts the launches that found the stream still busy. Prints calls, median and p90 µs and
the total ms per part.
"""

from __future__ import annotations

import collections
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_engine as be  # noqa: E402
import kvcanary.ops.check  # noqa: E402, F401  (the modules, not the functions the package re-exports)
import kvcanary.ops.landed  # noqa: E402, F401
import kvcanary.ops.launcher as launcher  # noqa: E402
import kvcanary.ops.scatter  # noqa: E402, F401
import kvcanary.ops.verify  # noqa: E402, F401


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("engine_launch_split.py needs CUDA (the kept compiled kernels)")
    engine, hooks = be.build("partial", "cuda", be.engine_options(True))
    for seed in (1000, 1001):
        be.run_on("partial", engine, hooks, be.workload(512, 96, seed=seed), 32)
    acc: dict[str, list[float]] = collections.defaultdict(list)
    busy: dict[str, list[bool]] = collections.defaultdict(list)

    def timed(f, label):
        return be.timed(f, label, lambda name, seconds: acc[name].append(seconds))

    kept = 0
    for k in launcher._kernels.values():
        name = k.fn.fn.__name__
        for kernel in k.compiled.values():
            run = kernel.run
            run.launch = timed(run.launch, f"C launch {name}")
            kernel._run = timed(run, f"kernel.run {name}")
            kept += 1
    print(f"kept compiled kernels wrapped: {kept}")
    direct = launcher.launch

    def launch(fn, *a, **kw):
        name = fn.fn.__name__
        busy[name].append(not torch.cuda.current_stream().query())
        t = time.perf_counter()
        try:
            return direct(fn, *a, **kw)
        finally:
            acc[f"ops launch {name}"].append(time.perf_counter() - t)

    for m in ("check", "landed", "scatter", "verify"):
        sys.modules[f"kvcanary.ops.{m}"].launch = launch
    for rep in range(3):
        r = be.run_on("partial", engine, hooks, be.workload(512, 96, seed=rep), 32)
        print(f"run {rep}: {r['seconds']:.3f} s, {r['tok_per_s']:.0f} tok/s, canary {r['canary_seconds'] * 1e3:.1f} ms "
              f"({r['canary_seconds'] / r['seconds']:.2%}), {r['steps']} steps")
    print(f"{'part':<36}{'calls':>6}{'med us':>9}{'p90':>9}{'total ms':>9}")
    for name, ts in sorted(acc.items()):
        s = sorted(ts)
        print(f"{name:<36}{len(s):>6}{statistics.median(s) * 1e6:9.1f}{s[int(0.9 * len(s))] * 1e6:9.1f}"
              f"{sum(s) * 1e3:9.2f}")
    for name, b in busy.items():
        print(f"stream busy before {name}: {sum(b)} of {len(b)}")


if __name__ == "__main__":
    main()
