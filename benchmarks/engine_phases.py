"""Where the warmed reference engine's host time goes, canary off against on, part by part.

    PYTHONPATH=src python3 benchmarks/engine_phases.py [--device cuda|cpu] [--runs 4] [--lockstep]
                                                       [--model bench|micro] [--requests 96]
                                                       [--modes partial,none]

Builds one engine per mode (off, partial, none; ``bench_engine.py``'s workload of 96 requests x
32 new tokens, graph-captured decode on CUDA), warms each up with a run, then times ``--runs``
interleaved runs per mode with timers around the engine's own parts (scheduling, the batch, the
graph load and replay, the eager forward, sampling, delivery, the host tier's offload), its hooks,
the canary's calls (``end_step`` also by the kind of step it ends: eager or replayed) and the
sweep's parts, plus Python's garbage collections. A part that grows with the canary on although
the canary's own timers do not cover it is a cost of the canary that its share leaves out.
Prints, per part and mode: total ms a run, median µs a call and calls a run; on CUDA, then each
captured decode graph replayed alone (device-bound, µs a replay). ``--lockstep``: each run steps
the modes' engines in turn (``bench_engine.run_lockstep``), so that every mode's parts are timed
under the same host conditions, a few milliseconds apart; ``--model``: ``bench_engine.MODELS``
(micro: a CPU step host-bound, as a graph-captured decode step on the H200 is); ``--modes``: the
canary modes beside "off", in ``bench_engine.py``'s syntax (e.g. ``off/readback,partial,
partial/readback``: the eager forwards' widths read back from the device, or not, part by part);
``--inner``: also time the canary's own calls inside its launches (the bound check, the kernel
launch, the state check, joins, the reporter's advance), to tell Python from a launch the
driver holds back; ``--sync-head``: every mode's eager forwards wait for the device before their
prologue (timed as "sync before eager prologue"), so that HEAD launches onto an idle queue;
``--as-replayed`` (CPU): the canary's hooks take every forward for a graph replay, so that they do
what they do after one (build the next sweep's runs: compare a mode with its ``/late`` twin).
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_engine as be  # noqa: E402
import kvcanary.engine.engine as engine_module  # noqa: E402
import kvcanary.ops.bound as bound_module  # noqa: E402
import kvcanary.ops.check_launch as launch_module  # noqa: E402
import kvcanary.ops.state as state_module  # noqa: E402
import kvcanary.runtime.forward as forward_module  # noqa: E402
import kvcanary.runtime.reporting as reporting_module  # noqa: E402
import kvcanary.runtime.route_triton as route_triton_module  # noqa: E402
import kvcanary.runtime.sweeping as sweeping_module  # noqa: E402
from kvcanary.runtime import sweep as sweep_module  # noqa: E402

MODES = ("off", "partial", "none")  # the default modes
CANARY_CALLS = ("sweep", "prefetch_sweep", "hold", "prepare_head", "end_step", "launch_head", "tail", "offload",
                "load_back", "rows_landed")
INNER = ((launch_module, "launch_typed"), (bound_module.BoundCheck, "__call__"), (state_module.DeviceState, "check"),
         (forward_module.Forward, "join"), (route_triton_module.TritonRoute, "join"),
         (forward_module.Forward, "scatter_pending"),
         (reporting_module.Reporter, "advance"))  # ``--inner``: (owner, name) of each call timed
HOOKS = ("before_forward", "after_forward", "after_step", "forward_prologue", "forward_epilogue", "before_move",
         "on_offload", "on_load", "on_free")


def _by_step_kind(canary, record):
    """``canary.end_step`` timed again under the kind of step it ends: "after eager" where every
    forward of the step ran eagerly (the canary counted no replay), else "after replays"."""
    end_step = canary.end_step

    def g(step):
        label = "canary.end_step after " + ("replays" if canary.route.replays else "eager")
        t = time.perf_counter()
        try:
            return end_step(step)
        finally:
            record(label, time.perf_counter() - t)
    return g


def _synced(engine, prologue, record):
    """``prologue`` (an engine's ``hooks.forward_prologue``) after a wait for the device on an eager
    forward (not a capture), the wait timed as its own part."""
    def g(batch):
        if not torch.cuda.is_current_stream_capturing():
            t = time.perf_counter()
            torch.cuda.synchronize()
            record("sync before eager prologue", time.perf_counter() - t)
        return prologue(batch)
    return g


def _as_replayed(engine, before_forward):
    """``before_forward`` (a canary's hook) with the engine's forward taken for a graph replay."""
    def g(batch):
        engine.replaying = True
        return before_forward(batch)
    return g


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--model", choices=sorted(be.MODELS), default="bench")
    ap.add_argument("--lockstep", action="store_true",
                    help="each run steps the modes' engines in turn instead of one run after another")
    ap.add_argument("--modes", default=",".join(MODES[1:]),
                    help="modes beside off, comma-separated (bench_engine.py's kind[/whole][/readback][@N])")
    ap.add_argument("--inner", action="store_true", help="also time the canary's calls inside its launches")
    ap.add_argument("--sync-head", action="store_true",
                    help="eager forwards wait for the device before their prologue (CUDA; timed apart)")
    ap.add_argument("--as-replayed", action="store_true",
                    help="the canary's hooks take every forward for a graph replay (CPU)")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.requests < 1:
        sys.exit(f"--runs and --requests must be >= 1, got {args.runs} and {args.requests}")
    modes = tuple(dict.fromkeys(["off", *args.modes.split(",")]))
    for m in modes:
        be.parse_mode(m)
    torch.set_num_threads(1)
    built = {m: be.build(m, args.device, be.engine_options(args.device == "cuda"), args.model) for m in modes}
    for m in modes:
        be.run_on(m, *built[m], be.workload(512, args.requests, seed=1000), 32)
    acc = {m: collections.defaultdict(list) for m in modes}
    mode = [None]  # the mode being timed; None: nothing is recorded (a run's own set-up)

    def record(label: str, seconds: float) -> None:
        if mode[0] is not None:
            acc[mode[0]][label].append(seconds)

    def timed(f, label):
        return be.timed(f, label, record)

    started = [0.0]

    def collections_timed(phase, info):
        if mode[0] is None:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            acc[mode[0]][f"gc gen{info['generation']}"].append(time.perf_counter() - started[0])

    gc.callbacks.append(collections_timed)
    engine_module.build_forward_batch = timed(engine_module.build_forward_batch, "build_forward_batch")
    build = engine_module.build_forward_batch

    def build_by_kind(plan, *a, **k):  # ... and again by kind: a decode batch, or one with a prefill in it
        decode = all(n == 1 and req.num_cached >= len(req.prompt_ids) for req, n in plan)
        return timed(build, "build_forward_batch, " + ("decode" if decode else "prefill or mixed"))(plan, *a, **k)

    engine_module.build_forward_batch = build_by_kind
    sweeping_module.sweep_entries = timed(sweeping_module.sweep_entries, "sweep_entries")
    for n in ("load", "_staged", "_verify_plan"):
        setattr(sweeping_module.Sweeper, n, timed(getattr(sweeping_module.Sweeper, n), f"Sweeper.{n}"))
    for n in ("entries", "joined"):
        setattr(sweep_module.RunCache, n, timed(getattr(sweep_module.RunCache, n), f"RunCache.{n}"))
    for owner, n in INNER if args.inner else ():
        label = f"{getattr(owner, '__name__', owner)}.{n}".removeprefix("kvcanary.ops.check_launch.")
        setattr(owner, n, timed(getattr(owner, n), label))
    graphs_class = getattr(sweeping_module, "SweepGraphs", None)  # an older tree has none
    for n in ("load", "again") if graphs_class is not None else ():
        setattr(graphs_class, n, timed(getattr(graphs_class, n), f"SweepGraphs.{n}"))
    def stepping(f, m):
        """``f`` (an engine's step) recording under mode ``m`` (``--lockstep`` switches mode every step)."""
        def g(*a, **k):
            before, mode[0] = mode[0], m
            try:
                return f(*a, **k)
            finally:
                mode[0] = before
        return g

    for m in modes:
        eng, hooks = built[m]
        eng.step = timed(eng.step, "Engine.step")
        if args.lockstep:
            eng.step = stepping(eng.step, m)
        eng._device_step = timed(eng._device_step, "eager _device_step")
        if args.as_replayed and hooks is not None:
            hooks.before_forward = _as_replayed(eng, hooks.before_forward)
        if args.sync_head and args.device == "cuda":
            eng.hooks.forward_prologue = _synced(eng, eng.hooks.forward_prologue, record)
        for owner, prefix, names in ((eng.scheduler, "", ("schedule", "postprocess")), (eng.sampler, "", ("sample",)),
                                     (eng.delivery, "delivery.", ("sampled", "advance")), (eng.hooks, "hooks.", HOOKS),
                                     (eng.graphs, "graphs.", ("load", "replay")),
                                     (eng.host_tier, "host_tier.", ("offload", "load"))):
            for n in names if owner is not None else ():
                if hasattr(owner, n):
                    setattr(owner, n, timed(getattr(owner, n), prefix + n))
        if hooks is not None:
            eng.prefix_cache_slots = timed(eng.prefix_cache_slots, "prefix_cache_slots")
            for n in CANARY_CALLS:
                if hasattr(hooks.canary, n):  # an older tree may lack one
                    setattr(hooks.canary, n, timed(getattr(hooks.canary, n), f"canary.{n}"))
            hooks.canary.end_step = _by_step_kind(hooks.canary, record)
    walls = collections.defaultdict(list)
    for k in range(args.runs):
        order = modes[k % len(modes):] + modes[: k % len(modes)]
        prompts = be.workload(512, args.requests, seed=k)
        done = be.run_lockstep({m: built[m] for m in order}, prompts, 32) if args.lockstep else {}
        for m in order:
            if not args.lockstep:
                mode[0] = m
                done[m] = be.run_on(m, *built[m], prompts, 32)
                mode[0] = None
            r = done[m]
            walls[m].append((round(r["seconds"], 3), r["steps"], round(r["canary_seconds"], 4)))
    for m in modes:
        print(f"{m} runs (s, steps, canary s): {walls[m]}")
    print(f"{'part (per run, ms; median us)':<28}" + "".join(f"{m:>22}" for m in modes))
    for label in sorted(set().union(*(acc[m].keys() for m in modes))):
        row = f"{label:<28}"
        for m in modes:
            ts = acc[m].get(label, [])
            row += f"{sum(ts) / args.runs * 1e3:10.2f} {statistics.median(ts) * 1e6 if ts else 0:8.1f} " \
                   f"{len(ts) // args.runs:3d}"
        print(row)
    if args.device != "cuda":
        return
    print("graph replay, device-bound loop (us per replay):")
    for m in modes:
        graphs, row = built[m][0].graphs, []
        for bs in sorted(graphs.captured):
            g = graphs.captured[bs].graph
            for _ in range(20):
                g.replay()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(200):
                g.replay()
            torch.cuda.synchronize()
            row.append(f"bs{bs}:{(time.perf_counter() - t) / 200 * 1e6:.1f}")
        print(m, " ".join(row))


if __name__ == "__main__":
    main()
