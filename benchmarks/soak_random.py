"""A clean soak across randomized configurations: every check on, zero violations expected.

    python benchmarks/soak_random.py --tokens 1000000 --deadline-s 3000 --json soak_random.json

Each configuration draws a model (tiny or hybrid sliding-window), page size 1/4/16, prefill chunk
7/64/128, a pool from tight to roomy (with a host tier), speculative drafts or decode padding to
graph batch sizes (padding lanes write slot 0), real-KV mode none/partial/all, token truth on/off,
sweep interval 1..7, and a built-in workload of its own seed; it runs to the end through the
reference engine with the canary (policy log) and adds its generated tokens and violations to
the totals. Stops at ``--tokens`` or ``--deadline-s``; with one worker the JSON is rewritten after
every configuration, so an interrupted soak still reports what it reached. ``--workers N`` runs N
soak loops in parallel processes (seeds ``seed * 1000 + w``, ``tokens / N`` each) and merges their
totals; ``--device cuda`` runs the engine on the GPU, padded decode steps replayed from CUDA graphs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import random
import time
from pathlib import Path

import torch

from kvcanary.config import CanaryConfig, Policy
from kvcanary.engine.canary_hooks import attach_canary
from kvcanary.engine.config import ModelConfig, SamplerKind
from kvcanary.engine.engine import Engine
from kvcanary.engine.workload import WorkloadConfig, builtin_workload, engine_config_for
from kvcanary.errors import CapacityError, ConfigError
from kvcanary.ops.fingerprint import FingerprintMode
from kvcanary.runs.driver import run_workload


def draw(rng: random.Random, seed: int, device: str = "cpu"):
    hybrid = rng.random() < 0.25
    model = ModelConfig(seed=seed, num_layers=4, sliding_window=8, window_layers=(0, 2)) if hybrid \
        else ModelConfig(seed=seed)
    workload = builtin_workload(WorkloadConfig(num_requests=rng.choice([96, 192, 384]), seed=seed,
                                               max_new_tokens=rng.choice([16, 32, 64]),
                                               block_size=rng.choice([4, 6, 16]), vocab_size=model.vocab_size))
    extra: dict = {"page_size": rng.choice([1, 4, 16]), "chunk_size": rng.choice([7, 64, 128])}
    base = engine_config_for(workload, device=device)
    extra["num_slots"] = max(base.num_slots // 64 * rng.choice([1, 2]) * 32, 2 * workload.max_request_len + 64)
    extra["num_slots"] = -(-extra["num_slots"] // 64) * 64
    extra["host_tier_slots"] = extra["num_slots"] if rng.random() < 0.8 else 0
    feature = rng.choice(["none", "drafts", "padding"])
    if feature == "drafts" and not hybrid:
        extra |= {"sampler": SamplerKind.ORACLE, "num_draft_tokens": rng.choice([1, 3])}
    elif feature == "padding":
        extra["graph_batch_sizes"] = (4, 8, 16)
        extra["cuda_graph"] = device != "cpu"  # on CUDA, padded decode steps replay captured graphs
    canary = CanaryConfig(policy=Policy.LOG, real_kv=rng.choice(list(FingerprintMode)), truth=rng.random() < 0.8,
                          sweep_interval=rng.choice([1, 4, 7]))
    engine = dataclasses.replace(base, **extra)
    return model, engine, canary, workload, {"hybrid": hybrid, "feature": feature, **{k: str(v) for k, v in
                                             extra.items()}, "real_kv": canary.real_kv.name, "truth": canary.truth,
                                             "sweep_interval": canary.sweep_interval}


def soak(seed: int, tokens: int, deadline_s: float, device: str, out: Path | None, tag: str = "") -> dict:
    """One soak loop: configurations drawn from ``seed`` until ``tokens`` or ``deadline_s``."""
    rng = random.Random(seed)
    t0 = time.perf_counter()
    totals = {"configurations": 0, "skipped_configurations": 0, "generated_tokens": 0, "requests": 0, "steps": 0,
              "violations": 0, "by_reason": {}, "watchdog_alarms": 0, "verified_slots": 0, "protected_slots": 0,
              "failures": [], "wall_seconds": 0.0}
    k = 0
    while totals["generated_tokens"] < tokens and time.perf_counter() - t0 < deadline_s:
        k += 1
        model, engine_config, canary, workload, desc = draw(rng, seed * 100_003 + k, device)
        try:
            engine, hooks = attach_canary(lambda h, m=model, e=engine_config: Engine(m, e, h), canary)
            counts = run_workload(engine, workload)
            final = hooks.flush(engine.step_index)
        except (ConfigError, CapacityError) as e:  # a draw the engine refuses: not a run
            totals["skipped_configurations"] += 1
            print(f"{tag}config {k} skipped: {e}", flush=True)
            continue
        reports = [v for r in hooks.reports for v in r.violations] + final.violations
        alarms = sum(len(r.alarms) for r in hooks.reports) + len(final.alarms)
        totals["configurations"] += 1
        totals["generated_tokens"] += counts.generated_tokens
        totals["requests"] += counts.requests
        totals["steps"] += counts.steps
        totals["violations"] += len(reports)
        totals["watchdog_alarms"] += alarms
        c = hooks.canary.counters()
        totals["protected_slots"] += c["HEAD"]["stamped"]
        totals["verified_slots"] += sum(c[p]["checked"] for p in ("HEAD", "TAIL", "SWEEP"))
        for v in reports:
            for name in v.line().split("reason=")[1].split()[0].split("+"):
                totals["by_reason"][name] = totals["by_reason"].get(name, 0) + 1
        if reports or alarms:
            totals["failures"].append({"seed": seed, "config": k, **desc,
                                       "first": reports[0].line() if reports else "watchdog"})
        totals["wall_seconds"] = time.perf_counter() - t0
        if out is not None:
            out.write_text(json.dumps(totals, indent=2) + "\n")
        print(f"{tag}config {k}: {counts.generated_tokens} tokens, {len(reports)} violations ({desc}); total "
              f"{totals['generated_tokens']} tokens, {totals['violations']} violations, "
              f"{totals['wall_seconds']:.0f} s", flush=True)
    totals["wall_seconds"] = time.perf_counter() - t0
    return totals


def _worker(args: tuple) -> dict:
    seed, tokens, deadline_s, device, index = args
    torch.set_num_threads(1)
    return soak(seed, tokens, deadline_s, device, None, tag=f"[worker {index}] ")


def merge(parts: list[dict]) -> dict:
    """The totals of several soak loops (wall time: the longest)."""
    out: dict = {"workers": len(parts)}
    for part in parts:
        for key, value in part.items():
            if key == "by_reason":
                for name, n in value.items():
                    out.setdefault(key, {})[name] = out.get(key, {}).get(name, 0) + n
            elif key == "failures":
                out.setdefault(key, []).extend(value)
            elif key == "wall_seconds":
                out[key] = max(out.get(key, 0.0), value)
            else:
                out[key] = out.get(key, 0) + value
    out.setdefault("by_reason", {})
    out.setdefault("failures", [])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--deadline-s", type=float, default=3000.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=1,
                    help="soak loops in parallel processes, each with its own seed and an equal share of --tokens")
    ap.add_argument("--device", default="cpu", help="engine device: cpu, or cuda (padded decode in CUDA graphs)")
    ap.add_argument("--json", type=Path, default=Path("soak_random.json"))
    args = ap.parse_args()
    if args.workers < 1:
        ap.error(f"--workers {args.workers} < 1")
    if args.workers == 1:
        totals = soak(args.seed, args.tokens, args.deadline_s, args.device, args.json)
    else:
        share = -(-args.tokens // args.workers)
        jobs = [(args.seed * 1000 + w, share, args.deadline_s, args.device, w) for w in range(args.workers)]
        with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
            totals = merge(pool.map(_worker, jobs))
    totals["device"] = args.device
    args.json.write_text(json.dumps(totals, indent=2) + "\n")
    print(json.dumps({k: v for k, v in totals.items() if k != "failures"}))


if __name__ == "__main__":
    main()
