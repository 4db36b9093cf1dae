"""HEAD alone at decode shapes, beside TAIL of the same batch: what HEAD's checks cost on the
device when nothing else runs (CUDA only).

    PYTHONPATH=src python3 benchmarks/bench_head.py --json head.json
    PYTHONPATH=src python3 benchmarks/bench_head.py --launch 256x8x1024                  # a launch shape
    ncu --clock-control none --profile-from-start off --section WarpStateStats \
        python3 benchmarks/bench_head.py --ncu 256x512                                   # one HEAD, profiled

Per shape (requests x prefix tokens): the canary of ``bench_tail_prefix.py`` (every prefix slot
stamped and fingerprinted), and a decode batch that reads each request's prefix and writes one
token at the next position. Timed alone in CUDA-graph replay: HEAD as the side stream runs it in
a step (``check_forward`` with ``stamp=True``, no sources: the write marks are ``mark_writes``'
launch on the model's stream), with and without token truth; ``marks`` is that launch alone;
TAIL identity of the same batch (after the marks; it reads none). Every timed launch must report zero violations.
"""
from __future__ import annotations

import argparse
import json

import torch

import kvcanary.ops.check as check_mod
import kvcanary.ops.launcher as launcher
import kvcanary.ops.state as state_mod
from bench_tail_prefix import NONE, Case, kv_sources, profile_once, report
from kvcanary.bench.timing import graph_us
from kvcanary.ops.landed import mark_writes


def patch_launch(spec: str) -> None:
    """HEAD's writer block, warps and verifier block from ``BxWxV`` (before any canary is built)."""
    block_t, warps, block_v = (int(x) for x in spec.split("x"))
    state_mod.WRITE_BLOCK = check_mod.WRITE_BLOCK = block_t
    check_mod.HEAD_WARPS = warps
    init = check_mod._CheckLaunch.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.constexprs["STAMP"]:
            self.block_v = self.constexprs["BLOCK_V"] = block_v
    check_mod._CheckLaunch.__init__ = patched


def head_kernels() -> str:
    """Registers and shared bytes of each HEAD variant compiled so far."""
    k = launcher._kernels.get(id(check_mod._check_kernel))
    if k is None:
        return ""
    out = {f"{c.n_regs} regs, {c.metadata.shared} B shared" for key, c in k.compiled.items() if key[2][0]}
    return "; ".join(sorted(out))


class HeadCase(Case):
    def __init__(self, bs, ctx, sources, num_slots, gen, dev, prefill=False):
        super().__init__(bs, ctx, sources, num_slots, gen, dev)
        self.decode = self.batch(0, ctx) if prefill else self.batch(ctx, 1)
        c = self.canary
        c.truth[1: bs + 1, : ctx + 1] = self.tokens[1: bs + 1].to(torch.int32)
        c.truth_lens[:bs] = ctx + 1

    def head(self, truth: bool):
        c = self.canary
        return self.check(self.decode, True, truth=c.truth if truth else None,
                          truth_lens=c.truth_lens[: self.bs] if truth else None, marks=c.marks)

    def marks(self):
        c, b = self.canary, self.decode

        def run():
            mark_writes(state=c.state, out_cache_loc=b.out_cache_loc, sources=c.sources, meta=c.meta,
                        mode=c.config.real_kv)
        return run

    def tail_decode(self):
        return self.check(self.decode, False, mode=NONE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x4096,64x4096,256x512,16x32768", help="requests x prefix tokens, ...")
    ap.add_argument("--ncu", default="", help="one shape: run its HEAD (no truth) once between profiler start/stop")
    ap.add_argument("--launch", default="", help="HEAD's writer block x warps x verifier block (an experiment)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.launch:
        patch_launch(args.launch)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(7)
    shapes = [(*(int(x) for x in s.rstrip("p").split("x")), s.endswith("p"))
              for s in (args.ncu or args.shapes).split(",")]
    num_slots = max(1 + max(bs * -(-(ctx + 1) // 16) for bs, ctx, _ in shapes) * 16, 524560)
    sources = kv_sources(num_slots, gen, dev)
    results = []
    for bs, ctx, prefill in shapes:
        case = HeadCase(bs, ctx, sources, num_slots, gen, dev, prefill)
        if args.ncu:
            profile_once(case.head(False))
            return
        before = case.violations()
        row = dict(shape=f"prefill {ctx} x bs {bs}" if prefill else f"bs {bs} @ {ctx}", launch=args.launch)
        row["head"] = graph_us([case.head(False)])
        row["head +truth"] = graph_us([case.head(True)])
        row["marks"] = graph_us([case.marks()])
        row["marks, head"] = graph_us([case.marks(), case.head(False)]) * 2
        row["tail identity"] = graph_us([case.marks(), case.tail_decode()]) * 2 - row["marks"]
        row["violations"] = case.violations() - before
        row["kernels"] = head_kernels()
        results.append(row)
        print(json.dumps(row), flush=True)
        del case
        torch.cuda.empty_cache()
    report(results, ("launch",), 15, args.json, also="kernels")


if __name__ == "__main__":
    main()
