"""Where the canary's host time goes inside the reference engine with graph-captured decode (CUDA).

Runs the `bench_engine.py` workload (96 requests x 32 new tokens, partial real-K/V, cuda graphs)
twice to warm every kernel variant and graph, then once more with timers around the canary's
methods, the ops' entry points, their validation, each launch (`ops launch`: `kvcanary.ops.launcher`,
the direct launch of a kept kernel; `triton launch`: Triton's own, `JITFunction.run`, which the
first launch of each variant takes), eager calls only (a graph replay runs none of them on the
host). Prints calls, median and mean µs and the total per part, largest first. The timers nest,
so a part includes the parts it calls, and each adds ~1 µs of its own.

    PYTHONPATH=src python3 benchmarks/engine_host_parts.py [--whole-truth] [--triton-launch]
    PYTHONPATH=src python3 benchmarks/engine_host_parts.py --profile N

``--profile N``: instead of the timers, run the workload under cProfile and print the N functions
with the most own time (the canary's, torch's and Triton's alike; cProfile slows each call, so
read the order, not the µs). ``--whole-truth``: every step hands its token truth as whole
histories (``EngineConfig.truth_appends = False``) instead of CUDA's default, decode truth as
appends. ``--triton-launch``: every launch through Triton's own (``JITFunction.run``), as before
the ops' direct launch.
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
from kvcanary.runtime import reporting, watchdog  # noqa: E402
from kvcanary.runtime.canary import Canary  # noqa: E402

CANARY_METHODS = ("launch_head", "_launch_head_overlapped", "start_tail", "_launch_tail", "tail", "prepare_head",
                  "end_step", "sweep", "_load_sweep_plan", "join", "_fork", "_check_truth_batch", "_account",
                  "_read_device_flags", "_apply_policy", "_report_device_flags", "hold", "_checked", "_staged")


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("engine_host_parts.py needs CUDA (graph-captured decode)")
    from triton.runtime.jit import JITFunction

    import kvcanary.ops.check  # noqa: F401  (the modules, not the functions the package re-exports)
    import kvcanary.ops.landed  # noqa: F401
    import kvcanary.ops.launcher  # noqa: F401
    import kvcanary.ops.scatter  # noqa: F401
    import kvcanary.ops.verify  # noqa: F401
    import kvcanary.runtime.canary  # noqa: F401
    chk, ld, sc, cm = (sys.modules[f"kvcanary.{m}"] for m in ("ops.check", "ops.landed", "ops.scatter",
                                                               "runtime.canary"))
    if "--triton-launch" in sys.argv[1:]:
        sys.modules["kvcanary.ops.launcher"]._driver = lambda: None
    prompts = be.workload(512, 48)
    opts = be.engine_options(True) | ({"truth_appends": False} if "--whole-truth" in sys.argv[1:] else {})
    for _ in range(2):
        be.run_once("partial", "cuda", prompts, 32, opts)
    if "--profile" in sys.argv[1:]:
        profile(prompts, opts, int(sys.argv[sys.argv.index("--profile") + 1]))
        return
    acc: dict[str, list[float]] = collections.defaultdict(list)

    def timed(f, label):
        """``f`` timed under ``label`` (a string, or a function of the call's first argument)."""
        def g(*a, **k):
            if torch.cuda.is_current_stream_capturing():
                return f(*a, **k)
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[label if isinstance(label, str) else label(a[0])].append(time.perf_counter() - t)
        return g

    def wrap(owner, name, label, *also):
        if not hasattr(owner, name):  # a part an older tree does not have (timed against this one)
            return
        g = timed(getattr(owner, name), label)
        for o in (owner, *also):
            setattr(o, name, g)

    for n in CANARY_METHODS:
        wrap(Canary, n, f"Canary.{n}")
    for n in ("validate_check", "validate_meta", "validate_marks"):
        wrap(chk, n, f"ops.check.{n}")
    wrap(chk, "check_forward", "ops.check.check_forward", cm)
    wrap(ld, "mark_writes", "ops.landed.mark_writes", cm)
    wrap(ld, "validate_landed", "ops.landed.validate_landed")
    wrap(sc, "scatter_validated", "ops.scatter.scatter_validated", cm)
    wrap(cm, "sweep_entries", "runtime.sweep.sweep_entries")
    for n in ("snapshot", "collect", "advance", "host_launches", "_copy_cuda", "_read"):
        wrap(reporting.Reporter, n, f"Reporter.{n}")
    wrap(chk._CheckLaunch, "launch", "ops.check._CheckLaunch.launch")
    # the runs' cached host arrays (``arrays``: before whole entries were kept)
    for n in ("entries", "joined", "arrays"):
        wrap(sys.modules["kvcanary.runtime.sweep"].RunCache, n, f"runtime.sweep.RunCache.{n}")
    wrap(watchdog.Watchdog, "observe_launches", "Watchdog.observe_launches")
    JITFunction.run = timed(JITFunction.run, lambda fn: f"triton launch {fn.fn.__name__}")
    direct = timed(sys.modules["kvcanary.ops.launcher"].launch, lambda fn: f"ops launch {fn.fn.__name__}")
    for module in (chk, ld, sc, sys.modules["kvcanary.ops.verify"]):
        module.launch = direct
    r = be.run_once("partial", "cuda", prompts, 32, opts)
    print(f"run: {r['seconds']:.3f} s, {r['steps']} steps, canary {r['canary_seconds'] * 1e3:.1f} ms "
          f"({r['canary_seconds'] / r['seconds']:.1%}; the timers' own cost included)")
    print(f"{'part':<40}{'calls':>6}{'med us':>9}{'mean us':>9}{'total ms':>9}")
    for name, ts in sorted(acc.items(), key=lambda x: -sum(x[1])):
        print(f"{name:<40}{len(ts):>6}{statistics.median(ts) * 1e6:9.1f}{statistics.mean(ts) * 1e6:9.1f}"
              f"{sum(ts) * 1e3:9.2f}")


def profile(prompts, opts, top: int) -> None:
    """One run under cProfile: the ``top`` functions by own time, then the canary's own methods."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    r = be.run_once("partial", "cuda", prompts, 32, opts)
    prof.disable()
    print(f"run (profiled): {r['seconds']:.3f} s, {r['steps']} steps, canary {r['canary_seconds'] * 1e3:.1f} ms")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(r"kvcanary/(runtime|ops)/", top)


if __name__ == "__main__":
    main()
