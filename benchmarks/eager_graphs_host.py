"""Host and device µs of an eager forward's HEAD and TAIL: the bound launches against the bucket
graphs (``CanaryConfig.eager_graphs``), at the shapes of an engine's prefill chunks.

    PYTHONPATH=src python3 benchmarks/eager_graphs_host.py [--device cuda] [--iters 300] [--json PATH]
                                                          [--shapes 1x0x128,4x0x64,8x256x32,16x512x16]

A shape ``BSxPREFIXxEXTEND``: BS requests, each reading PREFIX cached positions (stamped first,
with their token history) and writing the next EXTEND, its truth handed as appends, as the
reference engine's eager forwards do. Per shape, two canaries (partial fingerprints of one K
source) in one process, one with the option. Every iteration builds a fresh batch (new tensors,
as an engine's step does) and runs ``prepare_head(b, eager=True)`` and ``launch_head`` (HEAD),
the covered K/V writes, ``tail`` (TAIL) and ``end_step``, the two canaries in turn. Two passes:
host µs of HEAD and of TAIL with the device busy (a sleep kernel queued first, so that no call
waits for it), then device µs from HEAD's first launch to TAIL's end with the device idle (CUDA
events; the K/V writes included, the same in both). Medians of the iterations after the first
quarter (a bucket's capture falls in it); every step must report zero violations. ``--device
cpu`` (with ``TRITON_INTERPRET=1``) runs the same path on the interpreted kernel, a smoke run:
its timings say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvcanary import Canary, CanaryConfig, Half, KVSource, PoolGeometry
from kvcanary.bench.floors import StepShape
from kvcanary.bench.step_parts import StepBatch, uniform_batch, write_covered
from kvcanary.ops import FingerprintMode
from kvcanary.runtime.batch import ForwardBatch

PAGE = 16


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for part in text.split(","):
        fields = part.split("x")
        if len(fields) != 3 or not all(f.isdigit() for f in fields) or int(fields[0]) < 1 or int(fields[2]) < 1:
            raise SystemExit(f"shape {part!r}: BSxPREFIXxEXTEND, BS >= 1 and EXTEND >= 1, e.g. 4x256x64")
        shapes.append((int(fields[0]), int(fields[1]), int(fields[2])))
    return shapes


def with_truth(b: ForwardBatch, tokens: torch.Tensor, appends: bool) -> ForwardBatch:
    """``b`` with its token truth: appends from each prefix end, or whole histories."""
    bs, prefix, extend = b.batch_size, int(b.prefix_lens[0]), int(b.extend_lens[0])
    rows = b.req_pool_indices
    first = prefix if appends else 0
    ids = tokens[rows, first: prefix + extend].reshape(-1)
    offsets = torch.arange(bs + 1, device=rows.device) * (prefix + extend - first)
    return ForwardBatch(b.req_pool_indices, b.prefix_lens, b.extend_lens, b.req_to_token, b.input_ids, b.positions,
                        b.out_cache_loc, truth_ids=ids, truth_offsets=offsets,
                        truth_starts=b.prefix_lens.clone() if appends else None)


def build(device: str, bs: int, prefix: int, extend: int, graphs: bool, seed: int = 3) -> tuple[Canary, StepBatch]:
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = bs * ((prefix + extend) // PAGE + 2) + 1
    sb = StepBatch(StepShape("prefill", bs, prefix, extend), pages, PAGE, device, gen, 30_000)
    num_slots = PAGE * pages
    kv = torch.randn(num_slots, 2, 16, generator=gen, device=device).to(torch.bfloat16)
    config = CanaryConfig(real_kv=FingerprintMode.PARTIAL, max_bs=bs + 1, max_tokens=bs * max(prefix, extend),
                          sweep_interval=0, eager_graphs=graphs, fused=True if device == "cpu" else None)
    source = KVSource.from_buffer(kv, half=Half.K)
    c = Canary(config, PoolGeometry(num_slots, bs + 1, sb.held, device), sources=[source])
    if sb.fill is not None:
        fill = with_truth(sb.fill, sb.tokens, appends=False)
        with c.forward(fill):
            write_covered(c, fill)
    report = c.end_step(0)
    if report.violations:
        raise SystemExit(f"the fill reported {len(report.violations)} violations")
    return c, sb


def step(c: Canary, sb: StepBatch, n: int, busy: bool) -> tuple[float, float, float]:
    """One eager forward: (HEAD host s, TAIL host s, device ms from HEAD to TAIL's end or nan)."""
    shape = sb.shape
    b = with_truth(uniform_batch(sb.table, sb.tokens, shape.bs, shape.context, shape.extend), sb.tokens, True)
    cuda = sb.table.is_cuda
    if cuda:
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(400_000)  # the device busy for ~200 µs while the host runs HEAD and TAIL
    start = end = None
    if cuda and not busy:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    c.prepare_head(b, eager=True)
    c.launch_head(b)
    t1 = time.perf_counter()
    write_covered(c, b)
    t2 = time.perf_counter()
    c.tail(b)
    t3 = time.perf_counter()
    device = float("nan")
    if end is not None:
        end.record()
        end.synchronize()
        device = start.elapsed_time(end)
    report = c.end_step(n)
    if report.violations or report.device_flags:
        raise SystemExit(f"step {n}: {len(report.violations)} violations, flags {report.device_flags}")
    return t1 - t0, t3 - t2, device


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--shapes", default="1x0x128,4x0x64,8x256x32,16x512x16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    shapes = parse_shapes(args.shapes)
    cuda = args.device == "cuda"
    rows = []
    for bs, prefix, extend in shapes:
        built = {graphs: build(args.device, bs, prefix, extend, graphs) for graphs in (False, True)}
        times = {graphs: {"head": [], "tail": [], "device": []} for graphs in built}
        n = 1
        for busy in (True, False) if cuda else (True,):
            for _ in range(args.iters):
                for graphs, (c, sb) in built.items():
                    head, tail, device = step(c, sb, n, busy)
                    if busy:
                        times[graphs]["head"].append(head)
                        times[graphs]["tail"].append(tail)
                    else:
                        times[graphs]["device"].append(device)
                n += 1
        row = {"shape": f"{bs}x{prefix}x{extend}"}
        for graphs, t in times.items():
            mode = "graphs" if graphs else "launches"
            for part, values in t.items():
                kept = values[len(values) // 4:]
                scale = 1e3 if part == "device" else 1e6  # device: ms from the events; host: s
                row[f"{mode} {part} µs"] = round(statistics.median(kept) * scale, 1) if kept else None
        eager = built[True][0].route.eager
        row["graphs replays"], row["graphs buckets"] = eager.replays, len(eager.graphs)
        rows.append(row)
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu (interpreted: no GPU figure)'}; medians of "
          f"{args.iters - args.iters // 4} iterations")
    print("| shape | HEAD host, launches | HEAD host, graphs | TAIL host, launches | TAIL host, graphs "
          "| device, launches | device, graphs |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['launches head µs']} | {r['graphs head µs']} | {r['launches tail µs']} "
              f"| {r['graphs tail µs']} | {r['launches device µs']} | {r['graphs device µs']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "iters": args.iters, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
