"""Inside the warmed reference engine (CUDA, graph-captured decode, partial canary): the parts of
an eager HEAD and TAIL, of a sweep, or of a replayed step's ``end_step``, each part timed by a
wrapper around the function that does it. The wrappers nest, and each one is itself a Python call
layer between the model's launches, which is what this measures: compare a call's figure here
with the same call unwrapped (``engine_phases.py``) to see what a layer costs.

    PYTHONPATH=src python3 benchmarks/engine_call_layers.py --part eager     # HEAD, TAIL, the launch
    PYTHONPATH=src python3 benchmarks/engine_call_layers.py --part sweep
    PYTHONPATH=src python3 benchmarks/engine_call_layers.py --part end_step
    PYTHONPATH=src python3 benchmarks/engine_call_layers.py --part sweep --device cpu   # the CPU engine

Builds the ``bench_engine.py`` engine, warms it with one run, then times three runs (96 requests
x 32 new tokens each). ``--part eager`` splits the direct launch (``ops.launcher.launch_typed``)
into the current device, the key and lookup (``Fixed.moved`` included), the hook checks, the
current stream and Triton's launcher (``kernel.run``, or its C call where ``launcher._direct``
serves), with a copy of its kept-kernel path; a
launch that path does not take goes through the real one, untimed. ``--part end_step`` times
replayed and eager steps apart. Prints calls, median µs and ms a run per part. ``--device cpu``
runs the CPU engine instead (no graphs: every step is eager, sweeps take the compiled verify, and
Triton's launcher is not used).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_engine as be  # noqa: E402
import kvcanary.ops.check as check_module  # noqa: E402
import kvcanary.ops.launcher as launcher  # noqa: E402
from kvcanary.runtime import canary as canary_module  # noqa: E402
from kvcanary.runtime import sweep as sweep_module  # noqa: E402

RUNS = 3
acc: dict[str, list[float]] = collections.defaultdict(list)
timing = [True]  # whether a wrapper records (eager: only inside an eager forward)


def wrap(owner, name: str, label: str) -> None:
    f = getattr(owner, name)

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            if timing[0]:
                acc[label].append(time.perf_counter() - t)

    setattr(owner, name, timed)


class _TimedEvent:
    """The sweep graphs' staging event, its ``synchronize`` timed."""

    def __init__(self, event):
        self.event = event

    def synchronize(self) -> None:
        t = time.perf_counter()
        self.event.synchronize()
        if timing[0]:
            acc["the staging event's synchronize"].append(time.perf_counter() - t)

    def record(self, *a) -> None:
        self.event.record(*a)


def split_launch_typed() -> None:
    """``ops.check``'s ``launch_typed`` replaced by a timed copy of its kept-kernel path."""
    real = launcher.launch_typed
    pc = time.perf_counter

    def launch_typed(fn, grid, tensors, ints, variant, constexprs, num_warps=4, fixed=None, addresses=None):
        drv = launcher._driver()
        if drv is None:
            return real(fn, grid, tensors, ints, variant, constexprs, num_warps, fixed, addresses)
        get_device, get_stream, runtime = drv
        t0 = pc()
        device = get_device()
        t1 = pc()
        if addresses is None:
            addresses = list(map(launcher._ADDRESS, tensors))
        cache = fixed.typed if fixed is not None else launcher._kernel(fn).typed
        typed = cache.get((device, num_warps, variant, tuple(map(launcher._RESIDUE, addresses))))
        small = not ints or (max(ints) <= launcher._I32[1] and min(ints) >= launcher._I32[0])
        ok = typed is not None and small and (fixed is None or (typed.fixed_key is fixed.key and not fixed.moved()))
        t2 = pc()
        ok = ok and not getattr(fn, "pre_run_hooks", None) and not launcher._hooked(runtime)
        t3 = pc()
        if not ok:
            return real(fn, grid, tensors, ints, variant, constexprs, num_warps, fixed, addresses)
        g = (*grid, 1, 1)
        kernel, call = typed.kernel, typed.call
        stream = get_stream(device)
        t4 = pc()
        if call is None:
            kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None, None, None,
                       *typed.head, *addresses, *ints, *typed.tail)
        elif typed.packed:  # the launcher's C call (``launcher._direct``)
            call(g[0], g[1], g[2], stream, *typed.lead, (*typed.head, *addresses, *ints, *typed.tail))
        else:
            call(g[0], g[1], g[2], stream, *typed.lead, *typed.head, *addresses, *ints, *typed.tail)
        t5 = pc()
        if timing[0]:
            run = "launch: kernel.run" if call is None else "launch: the launcher's C call"
            for label, a, b in (("launch: current device", t0, t1), ("launch: key and lookup", t1, t2),
                                ("launch: hook checks", t2, t3), ("launch: current stream", t3, t4),
                                (run, t4, t5), ("launch: all of the above", t0, t5)):
                acc[label].append(b - a)

    check_module.launch_typed = launch_typed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("eager", "sweep", "end_step"), required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("engine_call_layers.py --device cuda needs CUDA")
    cuda = args.device == "cuda"
    eng, hooks = be.build("partial", args.device, be.engine_options(cuda))
    be.run_on("partial", eng, hooks, be.workload(512, 96, seed=1000), 32)
    c = hooks.canary
    if args.part == "eager":
        timing[0] = False
        head, tail = c.launch_head, c.tail

        def launch_head(b):
            timing[0] = not eng.replaying
            t = time.perf_counter()
            head(b)
            if timing[0]:
                acc["Canary.launch_head"].append(time.perf_counter() - t)

        def tail_(b):
            t = time.perf_counter()
            tail(b)
            if timing[0]:
                acc["Canary.tail"].append(time.perf_counter() - t)
            timing[0] = False

        for name in ("_checked", "_held_now", "join"):
            wrap(c, name, f"Canary.{name}")
        c.launch_head, c.tail = launch_head, tail_
        wrap(check_module.BoundCheck, "__call__", "BoundCheck.__call__")
        wrap(check_module.BatchMemo, "holds", "BatchMemo.holds")
        wrap(check_module.BatchMemo, "laid", "BatchMemo.laid")
        wrap(check_module._CheckLaunch, "launch_laid", "_CheckLaunch.launch_laid")
        wrap(type(c.state), "check", "DeviceState.check")
        split_launch_typed()
    elif args.part == "sweep":
        wrap(c, "sweep", "Canary.sweep")
        wrap(c, "_sweep_whole", "Canary._sweep_whole")
        wrap(c._runs, "entries", "RunCache.entries")
        wrap(sweep_module, "_entries", "_entries (new runs converted)")
        graphs = c._sweep_graphs
        if graphs is not None:
            wrap(graphs, "load_blocks", "SweepGraphs.load_blocks")
            wrap(graphs, "again", "SweepGraphs.again")
            wrap(graphs, "check", "SweepGraphs.check (DeviceState.check)")
            graphs.read = _TimedEvent(graphs.read)  # a torch.Event's methods cannot be replaced
    else:
        kind = ["?"]
        end = c.end_step

        def end_step(step):
            kind[0] = "replayed" if c._replays and eng.replaying else "eager"
            t = time.perf_counter()
            try:
                return end(step)
            finally:
                acc[f"{kind[0]}: Canary.end_step"].append(time.perf_counter() - t)

        c.end_step = end_step
        r = c.reporter
        parts = [(r, "advance", "Reporter.advance"), (r, "_read", "Reporter._read"),
                 (r, "host_launches", "Reporter.host_launches"),
                 (c.watchdog, "observe_tags", "Watchdog.observe_tags"),
                 (canary_module, "StepReport", "StepReport()"), (canary_module, "StepMeta", "StepMeta()")]
        # not ``_Snapshot``: ``Reporter.advance`` asks ``type(old) is _Snapshot``, which a wrapper in its
        # place would fail, sending every step down the general path
        if r.publication is not None:
            parts.append((r.publication, "read_into", "Publication.read_into"))
        for owner, name, label in parts:
            f = getattr(owner, name)

            def timed(*a, _f=f, _label=label, **k):
                t = time.perf_counter()
                try:
                    return _f(*a, **k)
                finally:
                    acc[f"{kind[0]}: {_label}"].append(time.perf_counter() - t)

            setattr(owner, name, timed)
    for k in range(RUNS):
        be.run_on("partial", eng, hooks, be.workload(512, 96, seed=k), 32)
    print(f"{'part':48s} {'calls':>6s} {'median µs':>10s} {'ms a run':>9s}")
    for label in sorted(acc):
        ts = acc[label]
        print(f"{label:48s} {len(ts):6d} {statistics.median(ts) * 1e6:10.1f} {sum(ts) * 1e3 / RUNS:9.2f}")


if __name__ == "__main__":
    main()
