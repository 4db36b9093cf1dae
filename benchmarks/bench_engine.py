"""Reference engine throughput with the canary on vs off, interleaved runs of one workload.

    python benchmarks/bench_engine.py [--device cpu|cuda] [--repeats 3] [--json PATH] [--cuda-graph]

Each repeat runs the same seeded workload once with the canary off and once per canary mode
(log policy), alternating, and reports generated tokens per second; the ratio on/off is the
figure. Every canary run must report zero violations (a clean workload). ``--cuda-graph`` runs
decode steps as CUDA-graph replays (``EngineConfig.cuda_graph``), the canary captured with them.
A mode with ``/whole`` (e.g. ``--modes partial,partial/whole``) hands every step's token truth as
whole histories instead of the default (on CUDA: decode truth as appends, ``EngineConfig.truth_appends``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

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


def run_once(mode: str, device: str, prompts, max_new: int, options: dict) -> dict:
    mc = ModelConfig(vocab_size=512, hidden=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
                     intermediate=768)
    kind, _, truth = mode.partition("/")
    if truth not in ("", "whole"):
        sys.exit(f"mode {mode!r}: the only suffix is /whole (token truth as whole histories)")
    if truth:
        options = {**options, "truth_appends": False}
    ec = EngineConfig(num_slots=2400, max_rows=33, max_ctx=256, host_tier_slots=600, max_running=24, device=device,
                      **options)
    if MODES[kind] is None:
        engine, hooks = Engine(mc, ec), None
    else:
        engine, hooks = attach_canary(lambda h: Engine(mc, ec, h),
                                      CanaryConfig(policy=Policy.LOG, real_kv=MODES[kind], sweep_interval=8))
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
    return {"mode": mode, "seconds": dt, "tokens": tokens, "tok_per_s": tokens / dt, "steps": engine.stats.num_steps,
            "violations": hooks.canary.totals.violations if hooks else 0,
            "canary_seconds": hooks.canary.totals.seconds if hooks else 0.0}


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def fmt(s: dict, digits: int) -> str:
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--modes", default="none,partial,all")
    ap.add_argument("--cuda-graph", action="store_true", help="decode steps as CUDA-graph replays (CUDA only)")
    ap.add_argument("--json", default=os.path.join(os.environ["OUT"], "bench_engine.json") if "OUT" in os.environ
                    else None)
    args = ap.parse_args(argv)
    if args.cuda_graph and args.device != "cuda":
        sys.exit(f"--cuda-graph needs --device cuda, got --device {args.device}")
    options = engine_options(args.cuda_graph)
    torch.set_num_threads(1)
    prompts = workload(512, args.requests)
    modes = ["off", *args.modes.split(",")]
    for m in modes:  # warm-up (kernel compiles, graph captures)
        run_once(m, args.device, prompts[:4], 4, options)
    runs = []
    for k in range(args.repeats):  # each repeat runs every mode once, in an order rotated by one each repeat
        order = modes[k % len(modes):] + modes[: k % len(modes)]
        runs += [dict(run_once(m, args.device, prompts, args.max_new_tokens, options), repeat=k) for m in order]
    env = environment(torch.device(args.device))
    print(f"device {env['device_name']}; {args.requests} requests x {args.max_new_tokens} new tokens; "
          f"{args.repeats} interleaved repeats (rotating order); cuda graph {'on' if args.cuda_graph else 'off'}; "
          "medians [min-max] over repeats; on/off: of each repeat's pair")
    print(f"{'mode':8} {'tok/s':>26} {'on/off':>22} {'canary share':>22} {'violations':>10}")
    off_of = {r["repeat"]: r["tok_per_s"] for r in runs if r["mode"] == "off"}
    summary = []
    for m in modes:
        rs = [r for r in runs if r["mode"] == m]
        tps = spread([r["tok_per_s"] for r in rs])
        ratio = spread([r["tok_per_s"] / off_of[r["repeat"]] for r in rs])
        share = spread([r["canary_seconds"] / r["seconds"] for r in rs])
        viol = sum(r["violations"] for r in rs)
        summary.append({"mode": m, "tok_per_s": tps["median"], "ratio": ratio["median"],
                        "canary_share": share["median"], "tok_per_s_spread": tps, "ratio_spread": ratio,
                        "canary_share_spread": share, "violations": viol})
        print(f"{m:8} {fmt(tps, 1):>26} {fmt(ratio, 3):>22} {fmt(share, 3):>22} {viol:10d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "environment": env, "cuda_graph": args.cuda_graph, "runs": runs,
                       "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
