"""Reference engine throughput with the canary on vs off, interleaved runs of one workload.

    python benchmarks/bench_engine.py [--device cpu|cuda] [--repeats 3] [--json PATH] [--cuda-graph]
                                      [--fresh-engines | --lockstep [STEPS]] [--model bench|micro]

One engine per mode (canary off, then each canary mode, log policy) is built once and warmed up
with a run of the timed workload's size (every kernel variant compiled, every decode size's graph
captured, the prefix cache filled), as a served engine is before its first request. Each repeat
then runs a fresh seeded workload on every engine, in an order rotated by one each repeat, and
reports generated tokens per second; the ratio on/off is the figure, and the canary share is the
canary's own time in that run over the run's wall time. Every canary run must report zero
violations (a clean workload). ``--cuda-graph`` runs decode steps as CUDA-graph replays
(``EngineConfig.cuda_graph``), the canary captured with them. ``--fresh-engines`` builds a new
engine for every run instead (its captures and first calls timed with it), as this benchmark did
before. A mode with ``/whole`` (e.g. ``--modes partial,partial/whole``) hands every step's token
truth as whole histories instead of the default (appends, ``EngineConfig.truth_appends``). A mode
with ``@N`` (e.g. ``--modes partial,partial@16,partial@0``) sweeps idle prefix-cache slots every N
steps instead of every 8 (``CanaryConfig.sweep_interval``; 0: no sweeps): the sweep interval's
cost, in the same run as the default's. A mode with ``/readback`` (e.g. ``--modes
partial,off/readback,partial/readback``) runs its eager forwards as the engine did before they
took their widths from the plan: the layout reads them back from the device, a host sync that
waits for everything launched before it (a canary's HEAD). Such a mode's on/off is against
``off/readback`` where that runs too, else against ``off``. A mode with ``/late`` does after
the sampling, or ahead of the next forward, what a replayed step now does while the device runs
its replay, as the engine did before: it builds each sweep's runs at the sweep
(``CanaryHooks.prefetch_sweeps``), and delivers the tokens of the step before after the sampling
(``Engine.early_delivery``). A mode with ``/graphs`` runs its eager forwards' HEAD and TAIL as
replays of the canary's bucket graphs (``CanaryConfig.eager_graphs``). Suffixes combine:
``partial/whole/readback@16``.

``--lockstep [STEPS]`` runs each repeat's workload on every engine at once, STEPS steps (default 1)
of each in turn (``run_lockstep``): whole runs one after another see the host drift by several
percent between them, while steps a few milliseconds apart see the same host. Each step is timed
from an idle device to its own work's end, so no engine's work lands in another's time (the
canary's work left in flight by a step is charged to that step). Each engine's first step of a
turn finds the caches holding another engine's work; more steps a turn bound that effect.

A repeat's pair ratios spread by several percent on a shared host, so a cost of 2 % needs many
repeats to resolve: each repeat prints its line as it ends, ``--deadline-s`` starts no repeat
after that many seconds (the repeats done are reported, so a time limit loses nothing), and the
summary gives a 95 % interval of the median on/off ratio (a percentile bootstrap over the
repeats' pairs, seeded).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import statistics
import sys
import time
from typing import NamedTuple

import torch

from kvcanary.bench.timing import environment
from kvcanary.config import CanaryConfig, Policy
from kvcanary.engine.canary_hooks import attach_canary
from kvcanary.engine.config import EngineConfig, ModelConfig
from kvcanary.engine.engine import Engine
from kvcanary.ops.fingerprint import FingerprintMode

MODES = {"off": None, "none": FingerprintMode.NONE, "partial": FingerprintMode.PARTIAL, "all": FingerprintMode.ALL}


def workload(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    systems = [torch.randint(0, vocab, (60,), generator=g).tolist() for _ in range(3)]
    return [systems[i % 3] + torch.randint(0, vocab, (int(torch.randint(5, 60, (1,), generator=g)),),
                                           generator=g).tolist() for i in range(n)]


def engine_options(cuda_graph: bool) -> dict:
    """EngineConfig options for graph-captured decode; a clear error where the engine has none."""
    if not cuda_graph:
        return {}
    if "cuda_graph" not in {f.name for f in dataclasses.fields(EngineConfig)}:
        sys.exit("--cuda-graph: this EngineConfig has no cuda_graph field (this engine has no graph-captured "
                 "decode); run without --cuda-graph")
    return {"cuda_graph": True, "graph_batch_sizes": (1, 2, 4, 8, 16, 24, 32)}


# the engine's model: "bench" (the default), or "micro", whose forward is so small that a CPU
# step is host-bound, as a graph-captured decode step is on the H200 (about 3 ms a step on the
# 2-core box against 38 ms for "bench")
MODELS = {"bench": ModelConfig(vocab_size=512, hidden=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
                               intermediate=768),
          "micro": ModelConfig(vocab_size=512, hidden=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                               intermediate=64)}


class ReadbackEngine(Engine):
    """The engine with its eager forwards reading their key and query widths back from the
    device (``/readback``): the layout's host sync that the plan's widths replaced."""

    def _device_step(self, batch, widths=None, static=False):
        return super()._device_step(batch, None, static)


class Mode(NamedTuple):
    kind: str  # a key of MODES
    whole: bool  # token truth as whole histories
    readback: bool  # ReadbackEngine
    sweep_interval: int
    late: bool = False  # sweep runs built at the sweep, tokens delivered after the sampling
    graphs: bool = False  # eager forwards' HEAD and TAIL replayed from graphs (CanaryConfig.eager_graphs)


def baseline(mode: str, modes) -> str:
    """The canary-off mode ``mode``'s on/off is taken against: ``off/readback`` for a ``/readback``
    mode where ``modes`` has it, else ``off``."""
    return "off/readback" if parse_mode(mode).readback and "off/readback" in modes else "off"


def build(mode: str, device: str, options: dict, model: str = "bench"):
    """(engine, hooks) for ``mode`` on ``model`` (``MODELS``); hooks is None with the canary off."""
    mc, m = MODELS[model], parse_mode(mode)
    if m.whole:
        options = {**options, "truth_appends": False}
    ec = EngineConfig(num_slots=2400, max_rows=33, max_ctx=256, host_tier_slots=600, max_running=24, device=device,
                      **options)
    engine = ReadbackEngine if m.readback else Engine
    if MODES[m.kind] is None:
        return engine(mc, ec), None
    built = attach_canary(lambda h: engine(mc, ec, h),
                          CanaryConfig(policy=Policy.LOG, real_kv=MODES[m.kind], sweep_interval=m.sweep_interval,
                                       eager_graphs=m.graphs))
    built[1].prefetch_sweeps = built[0].early_delivery = not m.late
    return built


def parse_mode(mode: str) -> Mode:
    """``kind[/whole][/readback][/late][/graphs][@N]`` as a ``Mode``; exits naming a bad one."""
    rest, at, every = mode.partition("@")
    kind, *suffixes = rest.split("/")
    if kind not in MODES:
        sys.exit(f"mode {mode!r}: the kind must be one of {', '.join(MODES)}, got {kind!r}")
    bad = ([x for x in suffixes if x not in ("whole", "readback", "late", "graphs")]
           or [x for x in set(suffixes) if suffixes.count(x) > 1])
    if bad:
        sys.exit(f"mode {mode!r}: a suffix after / is whole (token truth as whole histories), readback (eager "
                 f"forwards read their widths back), late (sweep runs built at the sweep, tokens delivered after "
                 f"the sampling) or graphs (eager HEAD and TAIL replayed from graphs), each at most once, got "
                 f"{bad[0]!r}")
    if "late" in suffixes and MODES[kind] is None:
        sys.exit(f"mode {mode!r}: /late is a canary mode's (the canary-off engine sweeps nothing and delivers "
                 f"in its step), got {kind!r}")
    if "graphs" in suffixes and MODES[kind] is None:
        sys.exit(f"mode {mode!r}: /graphs is a canary mode's (the canary-off engine has no HEAD or TAIL), "
                 f"got {kind!r}")
    if at and not (every.isdigit() and MODES[kind] is not None):
        sys.exit(f"mode {mode!r}: @ takes a sweep interval >= 0 (steps between sweeps, 0: none) of a canary mode, "
                 f"got {every!r}")
    return Mode(kind, "whole" in suffixes, "readback" in suffixes, int(every) if at else 8, "late" in suffixes,
                "graphs" in suffixes)


def run_on(mode: str, engine: Engine, hooks, prompts, max_new: int) -> dict:
    """One timed run of ``prompts`` on a built engine; the canary's time and violations are this
    run's (its totals' growth)."""
    device = engine.config.device
    totals = hooks.canary.totals if hooks is not None else None
    seconds0, violations0 = (totals.seconds, totals.violations) if totals is not None else (0.0, 0)
    steps0 = engine.stats.num_steps
    gc.collect()  # each run starts without the last one's garbage
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = engine.generate(prompts, max_new)
    if hooks is not None:
        hooks.canary.flush(engine.step_index)
    if device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = sum(len(v) for v in out.values())
    return {"mode": mode, "seconds": dt, "tokens": tokens, "tok_per_s": tokens / dt,
            "steps": engine.stats.num_steps - steps0,
            "violations": totals.violations - violations0 if totals is not None else 0,
            "canary_seconds": totals.seconds - seconds0 if totals is not None else 0.0}


def run_lockstep(engines: dict, prompts, max_new: int, turn: int = 1) -> dict:
    """One timed run of ``prompts`` on every built engine at once, step by step: each round of
    steps runs ``turn`` steps of every engine with work left, in an order rotated by one each round,
    the device idle before each step and synchronized at its end (inside its time), so every
    engine's steps are timed under the same host and device conditions, a few milliseconds apart.
    Returns ``run_on``'s dict by mode, the seconds being the sum of that engine's step times, with
    the steps split by kind: ``replayed_s``/``replayed`` (decode replayed from a graph; on CUDA
    also ``graph_device_s``, the replays' own device time, between CUDA events around each) and
    ``eager_s``/``eager``, the canary's own time in each kind (``replayed_canary_s``,
    ``eager_canary_s``), and the part of each kind's time spent waiting for the device after the
    step returned (``replayed_wait_s``, ``eager_wait_s``: the work it left in flight)."""
    modes = list(engines)
    cuda = next(iter(engines.values()))[0].config.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    start, ids = {}, {}
    acc = {m: {"seconds": 0.0, "replayed_s": 0.0, "replayed": 0, "eager_s": 0.0, "eager": 0, "graph_device_s": 0.0,
               "replayed_canary_s": 0.0, "eager_canary_s": 0.0, "replayed_wait_s": 0.0, "eager_wait_s": 0.0}
           for m in modes}
    marks: list = []  # the current step's (start, end) events around its graph replay
    replays: dict = {}  # mode -> the replay its graphs had as an attribute of their own, if any
    for m, (engine, hooks) in engines.items():
        totals = hooks.canary.totals if hooks is not None else None
        start[m] = ((totals.seconds, totals.violations) if totals is not None else (0.0, 0), engine.stats.num_steps)
        ids[m] = [engine.add_request(p, max_new) for p in prompts]
        if cuda and engine.graphs is not None:
            # over whatever replays there (another script's timer stays, and is put back after)
            replays[m] = vars(engine.graphs).get("replay")
            engine.graphs.replay = timed_replay(engine.graphs.replay, marks)
    gc.collect()
    k = 0
    try:
        while True:
            order = modes[k % len(modes):] + modes[: k % len(modes)]
            live = [m for m in order if engines[m][0].has_unfinished]
            if not live:
                break
            for m in [m for m in live for _ in range(turn)]:
                (engine, hooks), a = engines[m], acc[m]
                if not engine.has_unfinished:
                    continue
                totals = hooks.canary.totals if hooks is not None else None
                c0 = totals.seconds if totals is not None else 0.0
                sync()
                t0 = time.perf_counter()
                engine.step()
                t1 = time.perf_counter()
                sync()
                dt = time.perf_counter() - t0
                a["seconds"] += dt
                kind = "replayed" if engine.replaying else "eager"
                a[kind + "_s"] += dt
                a[kind + "_wait_s"] += dt - (t1 - t0)
                a[kind] += 1
                a[kind + "_canary_s"] += totals.seconds - c0 if totals is not None else 0.0
                for e0, e1 in marks:
                    a["graph_device_s"] += e0.elapsed_time(e1) / 1e3
                marks.clear()
            k += 1
    finally:
        for m, (engine, _) in engines.items():
            if cuda and engine.graphs is not None:
                if replays.get(m) is None:
                    vars(engine.graphs).pop("replay", None)  # the class's own method again
                else:
                    engine.graphs.replay = replays[m]
    out = {}
    for m, (engine, hooks) in engines.items():
        if hooks is not None:
            sync()
            t0 = time.perf_counter()
            hooks.canary.flush(engine.step_index)
            sync()
            acc[m]["seconds"] += time.perf_counter() - t0
        totals = hooks.canary.totals if hooks is not None else None
        (canary0, violations0), steps0 = start[m]
        tokens = sum(len(engine.output_ids(i)) for i in ids[m])
        out[m] = {"mode": m, **acc[m], "tokens": tokens, "tok_per_s": tokens / acc[m]["seconds"],
                  "steps": engine.stats.num_steps - steps0,
                  "violations": totals.violations - violations0 if totals is not None else 0,
                  "canary_seconds": totals.seconds - canary0 if totals is not None else 0.0}
    return out


def timed_replay(replay, marks: list):
    """``replay`` (a ``DecodeGraphs.replay``) with a CUDA event recorded on the current stream
    just before and just after it, appended to ``marks`` as a pair."""
    def f(batch):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        out = replay(batch)
        e1.record()
        marks.append((e0, e1))
        return out
    return f


def run_once(mode: str, device: str, prompts, max_new: int, options: dict) -> dict:
    """One run on a new engine (its graph captures and first calls timed with it)."""
    return run_on(mode, *build(mode, device, options), prompts, max_new)


def timed(f, label: str, record):
    """``f`` wrapped: each call's wall seconds go to ``record(label, seconds)`` (the timing scripts'
    one wrapper)."""
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            record(label, time.perf_counter() - t)
    return g


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def fmt(s: dict, digits: int) -> str:
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def median_interval(xs: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95 % interval of the median of ``xs``: the 2.5th and 97.5th percentiles of the medians
    of ``resamples`` resamples with replacement (seeded)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def mode_width(modes) -> int:
    """The printed tables' mode column: as wide as the longest mode, at least 12."""
    return max(12, *map(len, modes))


def by_kind(runs: list[dict], modes: list[str]) -> None:
    """Print, per mode and step kind, the median over repeats of the mean µs a step, its
    difference from the canary-off engine's (the median of the repeats' differences), the canary's
    own µs a step in it, what of the difference its own time does not explain (the median of the
    repeats' differences less their canary time), the µs a step waited for the device after it
    returned (what it left in flight) and that wait's difference, and (replayed steps) the graph
    replays' device µs and its difference; each mode against its ``baseline``."""
    med = statistics.median

    def per(r, key, kind):
        return 1e6 * r[key] / max(r[kind], 1)

    w = mode_width(modes)
    print(f"{'mode':{w}} {'kind':9} {'steps':>6} {'µs a step':>10} {'- off':>8} {'canary µs':>10} {'not canary':>10} "
          f"{'wait µs':>8} {'- off':>8} {'device µs':>10} {'- off':>8}")
    for m in modes:
        rs = [r for r in runs if r["mode"] == m]
        off = {r["repeat"]: r for r in runs if r["mode"] == baseline(m, modes)}
        for kind in ("replayed", "eager"):
            step = med(per(r, kind + "_s", kind) for r in rs)
            more = med(per(r, kind + "_s", kind) - per(off[r["repeat"]], kind + "_s", kind) for r in rs)
            canary = med(per(r, kind + "_canary_s", kind) for r in rs)
            rest = med(per(r, kind + "_s", kind) - per(off[r["repeat"]], kind + "_s", kind)
                       - per(r, kind + "_canary_s", kind) for r in rs)
            wait = med(per(r, kind + "_wait_s", kind) for r in rs)
            more_wait = med(per(r, kind + "_wait_s", kind) - per(off[r["repeat"]], kind + "_wait_s", kind) for r in rs)
            device = more_device = float("nan")
            if kind == "replayed":
                device = med(per(r, "graph_device_s", kind) for r in rs)
                more_device = med(per(r, "graph_device_s", kind) - per(off[r["repeat"]], "graph_device_s", kind)
                                  for r in rs)
            print(f"{m:{w}} {kind:9} {rs[0][kind]:6d} {step:10.1f} {more:8.1f} {canary:10.1f} {rest:10.1f} "
                  f"{wait:8.1f} {more_wait:8.1f} {device:10.1f} {more_device:8.1f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--modes", default="none,partial,all")
    ap.add_argument("--model", choices=sorted(MODELS), default="bench",
                    help="the engine's model (MODELS): micro makes a CPU step host-bound")
    ap.add_argument("--cuda-graph", action="store_true", help="decode steps as CUDA-graph replays (CUDA only)")
    ap.add_argument("--fresh-engines", action="store_true",
                    help="a new engine for every timed run (its captures and first calls timed with it)")
    ap.add_argument("--lockstep", type=int, nargs="?", const=1, default=0, metavar="STEPS",
                    help="each repeat runs the engines side by side, STEPS steps of each in turn (default 1; "
                         "run_lockstep), not one after another")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="start no repeat after this many seconds of timed runs (0: run every repeat)")
    ap.add_argument("--json", default=os.path.join(os.environ["OUT"], "bench_engine.json") if "OUT" in os.environ
                    else None)
    args = ap.parse_args(argv)
    if args.deadline_s < 0:
        sys.exit(f"--deadline-s must be >= 0 (0: no deadline), got {args.deadline_s}")
    if args.repeats < 1:
        sys.exit(f"--repeats must be >= 1, got {args.repeats}")
    if args.lockstep < 0:
        sys.exit(f"--lockstep takes a number of steps >= 1, got {args.lockstep}")
    if args.lockstep and args.fresh_engines:
        sys.exit("--lockstep runs warmed engines side by side; it does not take --fresh-engines")
    if args.cuda_graph and args.device != "cuda":
        sys.exit(f"--cuda-graph needs --device cuda, got --device {args.device}")
    options = engine_options(args.cuda_graph)
    torch.set_num_threads(1)
    modes = list(dict.fromkeys(["off", *args.modes.split(",")]))  # off first, each mode once (off named or not)
    for m in modes:
        parse_mode(m)
    engines = {}
    for m in modes:  # built and warmed up: kernels compiled, graphs captured, caches filled
        engines[m] = build(m, args.device, options, args.model)
        run_on(m, *engines[m], workload(512, args.requests, seed=1000), args.max_new_tokens)
    runs = []
    t0 = time.perf_counter()
    repeats = 0
    for k in range(args.repeats):  # each repeat runs every mode once, in an order rotated by one each repeat
        if k and args.deadline_s and time.perf_counter() - t0 > args.deadline_s:  # the first repeat always runs
            print(f"deadline: {k} of {args.repeats} repeats run in {args.deadline_s:g} s", flush=True)
            break
        order = modes[k % len(modes):] + modes[: k % len(modes)]
        prompts = workload(512, args.requests, seed=k)
        done = {}
        if args.lockstep:
            done = run_lockstep({m: engines[m] for m in order}, prompts, args.max_new_tokens, args.lockstep)
        for m in order:
            if not args.lockstep:
                engine, hooks = build(m, args.device, options, args.model) if args.fresh_engines else engines[m]
                done[m] = run_on(m, engine, hooks, prompts, args.max_new_tokens)
            runs.append(dict(done[m], repeat=k))
        repeats = k + 1
        print(f"repeat {k}: " + ", ".join(f"{m} {done[m]['tok_per_s']:.1f} tok/s "
                                          f"({done[m]['tok_per_s'] / done[baseline(m, modes)]['tok_per_s']:.3f})"
                                          for m in modes), flush=True)
    env = environment(torch.device(args.device))
    print(f"device {env['device_name']}; model {args.model}; {args.requests} requests x {args.max_new_tokens} new "
          "tokens; "
          f"{repeats} interleaved repeats (rotating order); cuda graph {'on' if args.cuda_graph else 'off'}; "
          f"{'a new engine a run' if args.fresh_engines else 'one warmed engine a mode'}"
          f"{f', the engines stepped in turn, {args.lockstep} steps a turn' if args.lockstep else ''}; "
          "medians [min-max] over repeats; on/off: of each repeat's pair"
          f"{' (a /readback mode against off/readback)' if 'off/readback' in modes else ''}")
    w = mode_width(modes)
    print(f"{'mode':{w}} {'tok/s':>26} {'on/off':>22} {'95 % of median':>16} {'canary share':>22} {'violations':>10}")
    summary = []
    for m in modes:
        rs = [r for r in runs if r["mode"] == m]
        off_of = {r["repeat"]: r["tok_per_s"] for r in runs if r["mode"] == baseline(m, modes)}
        tps = spread([r["tok_per_s"] for r in rs])
        ratios = [r["tok_per_s"] / off_of[r["repeat"]] for r in rs]
        ratio, interval = spread(ratios), median_interval(ratios)
        share = spread([r["canary_seconds"] / r["seconds"] for r in rs])
        viol = sum(r["violations"] for r in rs)
        summary.append({"mode": m, "against": baseline(m, modes), "tok_per_s": tps["median"],
                        "ratio": ratio["median"], "canary_share": share["median"], "tok_per_s_spread": tps,
                        "ratio_spread": ratio, "ratio_median_interval": interval,
                        "canary_share_spread": share, "violations": viol})
        band = f"{interval[0]:.3f}-{interval[1]:.3f}"
        print(f"{m:{w}} {fmt(tps, 1):>26} {fmt(ratio, 3):>22} {band:>16} {fmt(share, 3):>22} {viol:10d}")
    if args.lockstep:
        by_kind(runs, modes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "environment": env, "cuda_graph": args.cuda_graph, "repeats": repeats,
                       "lockstep": args.lockstep, "model": args.model,
                       "fresh_engines": args.fresh_engines, "runs": runs,
                       "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
