"""Host work per step of a graph-captured canary on CUDA: wall µs of ``prepare_head`` and
``end_step``, the calls an engine makes outside the graph every step.

    PYTHONPATH=src python3 benchmarks/bench_host.py --json host.json --profile host_profile.txt

Per case (decode batch size, context, real-KV mode, token truth off, as whole histories or as
appends, ``ForwardBatch.truth_starts``: then the graph appends it) a Canary over a pool
with K and V of two layers as sources stamps every request's prefix, HEAD (``launch_head``), a
device step of about ``--step-us`` µs and TAIL (``tail``) are captured in one CUDA graph, and
each timed step runs ``prepare_head``, replays the graph and runs ``end_step`` while the replay
is in flight, or (every other step) after the replay completed. The device is synchronised
before each step, so ``end_step`` never waits for the previous step (the host work itself, not
the device time). Figures: median [min-max] over the
timed steps after a warm-up; ``--profile`` writes a cProfile of the steps of every case. Every
step must report zero violations; a tripwire (one prefix chain word flipped for one step) must
be reported one step later. Uses only the public API.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch

from kvcanary import Canary, CanaryConfig, ForwardBatch, KVSource, PoolGeometry
from kvcanary.bench.step_parts import write_covered
from kvcanary.config import Policy
from kvcanary.core.record import CHAIN, Half, record_words
from kvcanary.ops.fingerprint import FingerprintMode

PAGE = 16


def build_case(bs: int, context: int, mode: FingerprintMode, truth: str, gen: torch.Generator):
    dev = torch.device("cuda")
    held = context + 1
    per_req = -(-held // PAGE)
    num_pages = 1 + bs * per_req
    num_slots = num_pages * PAGE
    pages = torch.randperm(num_pages - 1, generator=gen, device=dev)[: bs * per_req] + 1
    cols = torch.arange(held, device=dev)
    table = torch.zeros(bs + 1, held, dtype=torch.int32, device=dev)
    table[1:] = (pages.view(bs, per_req)[:, cols // PAGE] * PAGE + cols % PAGE).to(torch.int32)
    tokens = torch.randint(1, 32000, (bs + 1, held), generator=gen, device=dev)
    kv = [torch.randn(num_slots, 8, 16, generator=gen, device=dev).to(torch.bfloat16) for _ in range(4)]
    sources = [KVSource.from_buffer(buf, half=Half.K if i % 2 == 0 else Half.V, layer=i // 2 * 31)
               for i, buf in enumerate(kv)]
    config = CanaryConfig(policy=Policy.LOG, real_kv=mode, truth=truth != "off", max_bs=bs + 1,
                          max_tokens=max(bs * context, 1))
    canary = Canary(config, PoolGeometry(num_slots, bs + 1, held, "cuda"), sources=sources)

    def batch(prefix: int, extend: int) -> ForwardBatch:
        rows = torch.arange(1, bs + 1, device=dev)
        pos = torch.arange(prefix, prefix + extend, device=dev).repeat(bs)
        row_of = rows.repeat_interleave(extend)
        kw = {}
        n = prefix + extend
        if truth == "appends" and prefix:  # each request's new tokens, after the history the fill sent
            kw = dict(truth_ids=tokens[1:, prefix:n].reshape(-1).contiguous(),
                      truth_offsets=torch.arange(0, bs * extend + 1, extend, device=dev),
                      truth_starts=torch.full((bs,), prefix, device=dev))
        elif truth != "off":
            kw = dict(truth_ids=tokens[1:, :n].reshape(-1).contiguous(),
                      truth_offsets=torch.arange(0, bs * n + 1, n, device=dev))
        return ForwardBatch(req_pool_indices=rows, prefix_lens=torch.full((bs,), prefix, device=dev),
                            extend_lens=torch.full((bs,), extend, device=dev), req_to_token=table,
                            input_ids=tokens[row_of, pos], positions=pos, out_cache_loc=table[row_of, pos].long(),
                            **kw)

    fill, step = batch(0, context), batch(context, 1)
    canary.head(fill)
    write_covered(canary, fill)  # the model's K/V writes: TAIL requires every write target written
    canary.tail(fill)
    canary.end_step(0)
    return canary, step, table


def capture(canary: Canary, step: ForwardBatch, step_us: float) -> torch.cuda.CUDAGraph:
    cycles = int(step_us * 1.8e3)  # torch.cuda._sleep spins about this many cycles per µs
    fns = [lambda: canary.launch_head(step), lambda: write_covered(canary, step), lambda: torch.cuda._sleep(cycles),
           lambda: canary.tail(step)]
    canary.prepare_head(step)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    return graph


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def time_steps(canary: Canary, graph, step: ForwardBatch, steps: int, first: int, profile=None) -> dict:
    """Alternate steps: ``end_step`` with the replay in flight, then with the device idle (the
    replay synchronised first); the device is synchronised before each step."""
    out = {k: {"prepare_head": [], "end_step": [], "host": []} for k in ("in_flight", "idle")}
    viol = 0
    for i in range(2 * steps):
        kind = "in_flight" if i % 2 == 0 else "idle"
        torch.cuda.synchronize()
        if profile is not None and kind == "in_flight":
            profile.enable()
        t0 = time.perf_counter()
        canary.prepare_head(step)
        t1 = time.perf_counter()
        graph.replay()
        if kind == "idle":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        report = canary.end_step(first + i)
        t3 = time.perf_counter()
        if profile is not None:
            profile.disable()
        viol += len(report.violations)
        for name, us in (("prepare_head", t1 - t0), ("end_step", t3 - t2), ("host", t1 - t0 + t3 - t2)):
            out[kind][name].append(us * 1e6)
    res = {kind: {name: spread(v) for name, v in d.items()} for kind, d in out.items()}
    pub = getattr(canary.reporter, "publication", None)
    return res | {"violations": viol, "publishing": pub is not None,
                  "publication_fallbacks": pub.fallbacks if pub is not None else None}


def tripwire(canary: Canary, graph, step: ForwardBatch, table: torch.Tensor, at: int) -> bool:
    words = record_words(canary.state.records)
    slot = int(table[1, step.positions[0].item() // 2])
    saved = words[slot, CHAIN].clone()
    words[slot, CHAIN] ^= 1
    canary.prepare_head(step)
    graph.replay()
    torch.cuda.synchronize()
    words[slot, CHAIN] = saved
    seen = len(canary.end_step(at).violations)
    canary.prepare_head(step)
    graph.replay()
    seen += len(canary.end_step(at + 1).violations)
    torch.cuda.synchronize()
    return seen > 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--step-us", type=float, default=1000.0)
    ap.add_argument("--json")
    ap.add_argument("--profile")
    ap.add_argument("--truth", default="off,whole,appends", help="the token-truth kinds to run, in order")
    args = ap.parse_args()
    unknown = set(args.truth.split(",")) - {"off", "whole", "appends"}
    if unknown:
        ap.error(f"--truth: unknown kinds {sorted(unknown)}; choose from off, whole, appends")
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = [(bs, 4096, FingerprintMode.PARTIAL, truth) for truth in args.truth.split(",")
             for bs in (1, 64)]
    rows, prof = [], cProfile.Profile() if args.profile else None
    for bs, context, mode, truth in cases:
        canary, step, table = build_case(bs, context, mode, truth, gen)
        graph = capture(canary, step, args.step_us)
        time_steps(canary, graph, step, args.warmup, 1)
        r = time_steps(canary, graph, step, args.steps, 1 + 2 * args.warmup, prof)
        r["tripwire"] = tripwire(canary, graph, step, table, 2 + 2 * (args.warmup + args.steps))
        r.update(bs=bs, context=context, mode=mode.name.lower(), truth=truth)
        rows.append(r)
        del graph, canary
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(40)
        with open(args.profile, "w") as f:
            f.write(out.getvalue())
    s = lambda d: f"{d['median']:.1f} [{d['min']:.1f}-{d['max']:.1f}]"  # noqa: E731
    print(f"{'case':<34}{'device':>10}{'prepare_head µs':>24}{'end_step µs':>24}{'host µs':>24}  viol. "
          "tripwire publishing")
    for r in rows:
        case = f"decode bs {r['bs']} @ {r['context']} {r['mode']}{'' if r['truth'] == 'off' else ' ' + r['truth']}"
        for kind in ("in_flight", "idle"):
            k = r[kind]
            print(f"{case:<34}{kind:>10}{s(k['prepare_head']):>24}{s(k['end_step']):>24}{s(k['host']):>24}  "
                  f"{r['violations']:>5} {'caught' if r['tripwire'] else 'MISSED':>8} {r['publishing']} "
                  f"(fallbacks {r['publication_fallbacks']})")
    if any(r["violations"] or not r["tripwire"] for r in rows):
        raise SystemExit("a timed step reported a violation or a tripwire was missed")


if __name__ == "__main__":
    main()
