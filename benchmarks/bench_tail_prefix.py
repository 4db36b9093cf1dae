"""TAIL's prefix verify with and without fingerprints at decode shapes, beside a bare gather of
the same rows: what re-reading every prefix slot's K/V costs against what the memory system
gives for those reads (CUDA only).

    PYTHONPATH=src python3 benchmarks/bench_tail_prefix.py --json tail_prefix.json
    PYTHONPATH=src python3 benchmarks/bench_tail_prefix.py --launch 128x4,256x8,512x8   # launch shapes
    ncu --clock-control none --profile-from-start off --section MemoryWorkloadAnalysis \
        python3 benchmarks/bench_tail_prefix.py --ncu 64x4096                              # one TAIL, profiled

Per shape (requests x prefix tokens): a Canary (real-KV partial over K and V of two layers, each
a [slots, 8, 128] bf16 buffer of 1 GB, random 16-slot pages) stamps and fingerprints every
prefix; then TAIL alone (``check_forward`` with ``stamp=False`` on a batch that writes nothing:
the prefix verify) is captured in a CUDA graph and timed in replay, identity and partial.
``gather4`` is a bare Triton gather of the first 16 bytes of each prefix slot's row in the four
sources (``+records`` adds its record's words), the same rows TAIL's fingerprints read. Every
timed TAIL must report zero violations. ``--launch BxW`` times TAIL, identity and partial, with
verify block B and W warps (private attributes, for this experiment only).
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

import kvcanary.ops.check as check_mod
from kvcanary import Canary, CanaryConfig, ForwardBatch, Half, KVSource, LaunchPoint, PoolGeometry
from kvcanary.bench.step_parts import uniform_batch, write_covered
from kvcanary.bench.timing import graph_us
from kvcanary.config import Policy
from kvcanary.ops import FingerprintMode, check_forward

PAGE = 16
NONE, PARTIAL = FingerprintMode.NONE, FingerprintMode.PARTIAL
ROW_WORDS = 8 * 128 * 2 // 4  # int32 words in one slot's row of a [slots, 8, 128] bf16 buffer
LAUNCH: dict = {}  # --launch: the verify block and warps TAIL launches with (empty: its defaults)
_init = check_mod._CheckLaunch.__init__


def _launch_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    if LAUNCH and not self.constexprs["STAMP"]:
        self.block_v = self.constexprs["BLOCK_V"] = LAUNCH["block_v"]
        self.num_warps = LAUNCH["warps"]


check_mod._CheckLaunch.__init__ = _launch_init


@triton.jit
def _gather4(rtt_ptr, rtt_stride, ctx, rec_ptr, w0_ptr, w1_ptr, w2_ptr, w3_ptr, row_words, out_ptr,
             RECORDS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (r, b) reads the first 16 bytes of the rows of prefix positions [b*BLOCK, (b+1)*BLOCK)
    of page-table row r + 1 in four sources (and, with RECORDS, two words of their records)."""
    r = tl.program_id(0).to(tl.int64) + 1
    p = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = p < ctx
    slot = tl.load(rtt_ptr + r * rtt_stride + p, mask=m, other=0).to(tl.int64)
    base = tl.multiple_of(slot * row_words, 4)
    c = tl.arange(0, 4)
    a = tl.load(w0_ptr + base[:, None] + c[None, :], mask=m[:, None], other=0)
    b = tl.load(w1_ptr + base[:, None] + c[None, :], mask=m[:, None], other=0)
    d = tl.load(w2_ptr + base[:, None] + c[None, :], mask=m[:, None], other=0)
    e = tl.load(w3_ptr + base[:, None] + c[None, :], mask=m[:, None], other=0)
    x = tl.sum(a ^ b ^ d ^ e, axis=1).to(tl.int64)
    if RECORDS:
        x += tl.load(rec_ptr + slot * 4, mask=m, other=0) + tl.load(rec_ptr + slot * 4 + 3, mask=m, other=0)
    tl.store(out_ptr + (r - 1) * ctx + p, x, mask=m)


def page_table(bs: int, ctx: int, num_pages: int, gen, dev) -> torch.Tensor:
    per_req = -(-(ctx + 1) // PAGE)
    pages = torch.randperm(num_pages - 1, generator=gen, device=dev)[: bs * per_req] + 1
    cols = torch.arange(ctx + 1, device=dev)
    table = torch.zeros(bs + 1, ctx + 1, dtype=torch.int32, device=dev)
    table[1:] = (pages.view(bs, per_req)[:, cols // PAGE] * PAGE + cols % PAGE).to(torch.int32)
    return table


class Case:
    """One shape: a canary whose every prefix slot is stamped and fingerprinted, and the batch
    that reads those prefixes and writes nothing."""

    def __init__(self, bs: int, ctx: int, sources, num_slots: int, gen, dev):
        self.bs, self.ctx = bs, ctx
        self.table = page_table(bs, ctx, num_slots // PAGE, gen, dev)
        self.tokens = torch.randint(1, 32000, (bs + 1, ctx + 1), generator=gen, device=dev)
        config = CanaryConfig(policy=Policy.LOG, real_kv=PARTIAL, max_bs=bs + 1, max_tokens=bs * ctx)
        self.canary = Canary(config, PoolGeometry(num_slots, bs + 1, ctx + 1, "cuda"), sources=sources)
        fill = self.batch(0, ctx)
        self.canary.head(fill)
        write_covered(self.canary, fill)
        self.canary.tail(fill)
        self.canary.flush(0)
        self.prefix = self.batch(ctx, 0)

    def batch(self, prefix: int, extend: int) -> ForwardBatch:
        return uniform_batch(self.table, self.tokens, self.bs, prefix, extend)

    def check(self, b: ForwardBatch, stamp: bool, **kwargs):
        """``check_forward`` of ``b`` on the canary's state: HEAD (``stamp``) or TAIL, with ``kwargs``."""
        c = self.canary
        tag = c.tag(LaunchPoint.HEAD if stamp else LaunchPoint.TAIL)

        def run():
            check_forward(state=c.state, req_pool_indices=b.req_pool_indices, prefix_lens=b.prefix_lens,
                          extend_lens=b.extend_lens, req_to_token=b.req_to_token, input_ids=b.input_ids,
                          positions=b.positions, out_cache_loc=b.out_cache_loc, tag=tag, stamp=stamp, **kwargs)
        return run

    def tail(self, mode: FingerprintMode):
        c = self.canary
        sources, meta = (c.sources, c.meta) if mode is not NONE else ((), None)
        return self.check(self.prefix, False, sources=sources, mode=mode, meta=meta)

    def gather(self, records: bool):
        words = [s.words for s in self.canary.sources]
        recs = self.canary.state.records.view(torch.int64)
        out = torch.empty(self.bs * self.ctx, dtype=torch.int64, device=self.table.device)
        grid = (self.bs, triton.cdiv(self.ctx, 256))

        def run():
            _gather4[grid](self.table, self.table.stride(0), self.ctx, recs, *words, ROW_WORDS, out,
                           RECORDS=records, BLOCK=256)
        return run

    def violations(self) -> int:
        torch.cuda.synchronize()
        return int(self.canary.state.ring_counter[0])


def time_case(case: Case, launches: list[str]) -> dict:
    row = dict(shape=f"bs {case.bs} @ {case.ctx}", rows=case.bs * case.ctx * len(case.canary.sources))
    before = case.violations()
    row["identity"] = graph_us([case.tail(NONE)])
    row["partial"] = graph_us([case.tail(PARTIAL)])
    for spec in launches:
        block, warps = (int(x) for x in spec.split("x"))
        LAUNCH.update(block_v=block, warps=warps)
        row[f"identity {spec}"] = graph_us([case.tail(NONE)])
        row[f"partial {spec}"] = graph_us([case.tail(PARTIAL)])
        LAUNCH.clear()
    row["gather4"] = graph_us([case.gather(False)])
    row["gather4 +records"] = graph_us([case.gather(True)])
    row["violations"] = case.violations() - before
    return row


def kv_sources(num_slots: int, gen, dev) -> list[KVSource]:
    """K and V of layers 0 and 31: four random [num_slots, 8, 128] bf16 buffers."""
    kv = [torch.empty(num_slots, 8, 128, dtype=torch.bfloat16, device=dev) for _ in range(4)]
    for t in kv:
        t.view(torch.int16).random_(generator=gen)
    return [KVSource.from_buffer(buf, half=Half.K if i % 2 == 0 else Half.V, layer=i // 2 * 31)
            for i, buf in enumerate(kv)]


def profile_once(run) -> None:
    """``run`` once to warm up, then once between the profiler's start and stop."""
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def report(results: list[dict], skip: tuple, width: int, json_path: str, also: str = "") -> None:
    """The table of ``results`` (µs columns, all but ``shape``, ``violations`` and ``skip``; the
    field ``also`` last, as text), then the JSON at ``json_path`` when given."""
    keys = [k for k in results[0] if k not in ("shape", "violations", also, *skip)]
    print(f"\n{'µs in graph replay':18s}" + "".join(f"{k:>{width}s}" for k in keys) + "  violations")
    for r in results:
        print(f"{r['shape']:18s}" + "".join(f"{r[k]:{width}.1f}" for k in keys) + f"  {r['violations']}"
              + (f"  {r[also]}" if also else ""))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x4096,64x4096,256x512,16x32768", help="requests x prefix tokens, ...")
    ap.add_argument("--launch", default="", help="TAIL verify block x warps to time besides the defaults, ...")
    ap.add_argument("--ncu", default="", help="one shape: run its partial TAIL once between profiler start/stop")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(7)
    shapes = [tuple(int(x) for x in s.split("x")) for s in (args.ncu or args.shapes).split(",")]
    num_slots = max(1 + max(bs * -(-(ctx + 1) // PAGE) for bs, ctx in shapes) * PAGE, 524560)
    sources = kv_sources(num_slots, gen, dev)
    results = []
    for bs, ctx in shapes:  # one canary at a time: each fill rewrites rows an earlier one fingerprinted
        case = Case(bs, ctx, sources, num_slots, gen, dev)
        if args.ncu:
            profile_once(case.tail(PARTIAL))
            return
        results.append(time_case(case, list(filter(None, args.launch.split(",")))))
        print(json.dumps(results[-1]), flush=True)
        del case
        torch.cuda.empty_cache()
    report(results, ("rows",), 18, args.json)


if __name__ == "__main__":
    main()
