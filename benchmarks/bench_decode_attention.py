"""The real step's decode attention alone (``kvcanary.bench.paged_attention.DecodeAttention``): µs
per layer in CUDA-graph replay and the K/V read rate, per shape and split target (CUDA only).

    PYTHONPATH=src python3 benchmarks/bench_decode_attention.py                       # the step's decode shapes
    PYTHONPATH=src python3 benchmarks/bench_decode_attention.py --targets 2048,4096,8192,16384
    PYTHONPATH=src python3 benchmarks/bench_decode_attention.py --tiles large         # the six large tiles only

Per shape (requests x prefix tokens): one layer's K and V pool as the real step holds it (524560
slots, 8 KV heads x 128, bf16, 1 GB each), each request's page-table row a run of random 16-slot
pages, 32 query heads. For each split target (``target_programs``: keys are split so that
requests x KV heads x splits fill that many programs) the kernel picks its tile on the first call,
then 8 launches are captured in a graph and replayed 15 times; the table gives the median µs per
launch (split and merge), the K/V bytes over that time, the largest difference from the float32
reference on four requests, and the tile picked. ``--tiles large`` tunes over the six tiles the
kernel had before the small ones were added (the before of that change).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from kvcanary.bench import paged_attention as pa

SLOTS, KV_HEADS, HEADS, HEAD_DIM, PAGE = 524560, 8, 32, 128, 16
LARGE_TILES = ((64, 4, 3), (64, 4, 2), (128, 4, 2), (128, 8, 3), (32, 4, 4), (64, 8, 3))  # BLOCK_N, warps, stages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="64x512,64x4096,256x512,16x32768", help="requests x prefix tokens, ...")
    ap.add_argument("--targets", default="2048", help="split targets (programs), comma separated")
    ap.add_argument("--tiles", choices=("all", "large"), default="all")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_attention.py needs CUDA")
    if args.tiles == "large":
        configs = [pa.triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=st) for n, w, st in LARGE_TILES]
        pa._decode_tuned = pa.triton.autotune(configs, key=["chunk", "num_splits", "bs"])(pa._decode_split_kernel)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    k = torch.randn(SLOTS, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev, generator=gen)
    v = torch.randn(SLOTS, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev, generator=gen)
    print(f"{'shape':>12} {'target':>7} {'splits':>6} {'us/layer':>9} {'TB/s':>6} {'max err':>8}  tile")
    for shape in args.shapes.split(","):
        bs, ctx = (int(x) for x in shape.split("x"))
        held = ctx + 1
        per = -(-held // PAGE)
        pages = torch.randperm(SLOTS // PAGE - 1, generator=gen, device=dev)[: bs * per] + 1
        cols = torch.arange(held, device=dev)
        table = torch.zeros(bs + 1, held, dtype=torch.int32, device=dev)
        table[1:] = (pages.view(bs, per)[:, cols // PAGE] * PAGE + cols % PAGE).to(torch.int32)
        rows = torch.arange(1, bs + 1, device=dev)
        prefix = torch.full((bs,), ctx, device=dev)
        q = torch.randn(bs, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev, generator=gen)
        few = min(bs, 4)
        ref = pa.paged_attention_torch(q[:few], k, v, table, rows[:few], prefix[:few],
                                       torch.ones(few, dtype=torch.int64, device=dev))
        nbytes = bs * held * KV_HEADS * HEAD_DIM * 2 * 2
        for target in (int(t) for t in args.targets.split(",")):
            att = pa.DecodeAttention(bs, HEADS, KV_HEADS, HEAD_DIM, held, dev, target_programs=target)
            out = torch.empty_like(q)
            att(q, k, v, table, rows, prefix, out)  # picks the tile (before any capture)
            err = (out[:few].float() - ref.float()).abs().max().item()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(8):
                    att(q, k, v, table, rows, prefix, out)
            graph.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(15):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                graph.replay()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3 / 8)
            us = statistics.median(times)
            print(f"{bs:>5}x{ctx:<6} {target:>7} {att.num_splits:>6} {us:9.1f} {nbytes / us / 1e6:6.2f} {err:8.4f}  "
                  f"{pa.tuned_tiles()['decode']}", flush=True)


if __name__ == "__main__":
    main()
