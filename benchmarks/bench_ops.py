"""Cross-check and time the canary ops (scatter, gather, build_plan, stamp, verify, fingerprint).

1. correctness: the Triton kernel and the torch path (``Backend.TORCH``) run on the same random
   inputs at the target shapes; every output buffer is compared element for element, ring rows
   as a multiset (kernels append them in any order);
2. timing: each Triton launch is captured in a CUDA graph; median µs per launch from CUDA events
   around batches of replays, next to the torch path on the same device (graph-captured where
   it has no host sync, else eager). Inputs smaller than L2 rotate over independent sets (one
   graph launches each set once) so launches read HBM; rows still L2-resident are marked "L2";
3. floor: bytes the op must move / copy bandwidth measured in the same run; verify is also put
   against a random 32-byte gather ceiling, fingerprint ALL against the copy bandwidth.

    python benchmarks/bench_ops.py                    # full run on CUDA
    python benchmarks/bench_ops.py --check-only       # correctness only
    TRITON_INTERPRET=1 python benchmarks/bench_ops.py --quick   # CPU smoke run, tiny shapes
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import statistics
import sys
import time
import traceback
from contextlib import contextmanager
from functools import partial

import torch

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import (kvcanary.ops imports it)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvcanary.core import record as rec  # noqa: E402
from kvcanary.ops._common import Backend  # noqa: E402
from kvcanary.ops.fingerprint import FingerprintMode, KVSource, fingerprint, source_meta  # noqa: E402
from kvcanary.ops.gather import gather_expected_tokens  # noqa: E402
from kvcanary.ops.plan import Plan, build_plan  # noqa: E402
from kvcanary.ops.scatter import scatter_req_token_ids  # noqa: E402
from kvcanary.ops.stamp import stamp  # noqa: E402
from kvcanary.ops.verify import verify  # noqa: E402

TRI, TORCH = Backend.TRITON, Backend.TORCH
NONE, PARTIAL, ALL = FingerprintMode.NONE, FingerprintMode.PARTIAL, FingerprintMode.ALL
TAG = rec.LaunchTag(rec.LaunchPoint.HEAD).value
L2_BYTES = 60e6
RING_OUTS = ["canary", "ring", "ring_counter", "stats"]
DEV = torch.device("cuda" if CUDA else "cpu")
GEN = torch.Generator(device=DEV)
FULL = dict(scatter=[(1, 128), (64, 2048), (256, 8192), (1024, 4096), (4096, 256)], gather=(256, 8192),
            stamp=[1, 512, 4096, 32768], decode_bs=256, num_slots=1 << 22, world=(3, 256, 4096),
            plan_long=32768, kv=(8, 128), fp_slots=32768, max_sets=128, copy_bytes=4 << 30, full=True)
QUICK = dict(scatter=[(1, 128), (5, 40)], gather=(3, 50), stamp=[1, 40, 1500], decode_bs=6, num_slots=1 << 14,
             world=(2, 4, 64), plan_long=300, kv=(2, 8), fp_slots=100, max_sets=2, copy_bytes=64 << 20,
             full=False)
S: dict = {}  # the shapes in use, plus "timing"
BW: dict = {}  # GB/s: copy (read+written), gather (useful bytes of random 32-byte rows)
R: dict = {"correctness": [], "timing": [], "errors": [], "sections": {}}


def rnd(*shape, lo=1, hi=2**31 - 1, dtype=torch.int64):
    """Random integers in [lo, hi): inputs are never zeros unless lo is 0."""
    return torch.randint(lo, hi, shape, generator=GEN, device=DEV, dtype=dtype)


def perm(n):
    """A random permutation of 1..n (distinct rows or slots, none of them the reserved 0)."""
    return torch.randperm(n, generator=GEN, device=DEV) + 1


def ar(n, scale=1):
    return torch.arange(n, device=DEV) * scale


def full_(n, value):
    return torch.full((n,), value, dtype=torch.int64, device=DEV)


@contextmanager
def section(name):
    """Run one part; record an error and go on (a failing op must not lose the rest of the run)."""
    t0 = time.perf_counter()
    if S["timing"] and t0 - S["t0"] > S["budget"]:
        S["timing"] = False
        print(f"time budget of {S['budget']} s spent: timing off from here, correctness only", flush=True)
    try:
        yield
    except Exception as e:
        R["errors"].append({"section": name, "error": repr(e), "traceback": traceback.format_exc()})
        print(f"ERROR     {name}: {e!r}", flush=True)
    R["sections"][name] = round(time.perf_counter() - t0, 2)
    save()


def save():
    """Write the details so far (after every section, so a killed run still leaves them)."""
    R["meta"]["elapsed_s"], R["bandwidth_GBps"] = round(time.perf_counter() - S["t0"], 1), BW
    if S["json"]:
        try:
            with open(S["json"], "w") as f:
                json.dump(R, f, indent=1, default=str)
        except OSError as e:
            print(f"cannot write {S['json']}: {e!r}")
            S["json"] = None


# --- correctness -------------------------------------------------------------------------

def tensors(name, v):
    if isinstance(v, Plan):
        return [(f"{name}.{f.name}", getattr(v, f.name)) for f in dataclasses.fields(v)]
    return [(name, v)]


def clone(v):
    return Plan(*[t.clone() for _, t in tensors("", v)]) if isinstance(v, Plan) else v.clone()


def cross(name, op, kw, outs, expect_rows=None):
    """Run ``op`` on Triton and on torch, each on its own copy of ``outs``; compare them all."""
    a, b = ({k: clone(v) if k in outs else v for k, v in kw.items()} for _ in range(2))
    op(**a, backend=TRI)
    op(**b, backend=TORCH)
    problems, names = [], []
    for key in outs:
        if key == "ring":
            continue
        for (label, x), (_, y) in zip(tensors(key, a[key]), tensors(key, b[key]), strict=True):
            names.append(label)
            x, y = x.reshape(-1), y.reshape(-1).to(x.device)
            diff = (x != y).nonzero().flatten()
            if diff.numel():
                problems.append(f"{label}: {diff.numel()} of {x.numel()} differ, first at {diff[:5].tolist()}")
    rows = None
    if "ring" in outs:
        ra, rb = (collections.Counter(map(tuple, k["ring"][: min(int(k["ring_counter"][0]), len(k["ring"]))].tolist()))
                  for k in (a, b))
        rows = sum(ra.values())
        if ra != rb:
            problems.append(f"ring rows: {sum((ra - rb).values())} only from triton, "
                            f"{sum((rb - ra).values())} only from torch")
        if (expect_rows == 0 and rows) or (expect_rows == ">0" and not rows):
            problems.append(f"{rows} violation rows, expected {expect_rows}")
        names.append(f"ring ({rows} rows)")
    ok = not problems
    R["correctness"].append({"name": name, "ok": ok, "compared": names, "problems": problems, "ring_rows": rows})
    print(f"{'OK' if ok else 'MISMATCH':<9} {name}: " + ("; ".join(problems) if problems else ", ".join(names)),
          flush=True)
    return ra if rows is not None else None


# --- timing ------------------------------------------------------------------------------

def median_us(fn, reps, batches):
    torch.cuda.synchronize()
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(batches)]
    for start, end in ev:
        start.record()
        for _ in range(reps):
            fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev) * 1e3 / reps


def run_all(fns):
    for f in fns:
        f()


def graph_us(fns, reps=20, batches=30):
    """Median µs per launch: one graph launches every function once; batches of ``reps`` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run_all(fns)  # warm-up: compiles kernels, settles the allocator
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_all(fns)
    return median_us(graph.replay, reps, batches) / len(fns)


def eager_us(fns, batches=10):
    run_all(fns)
    return median_us(partial(run_all, fns), max(1, 8 // len(fns)), batches) / len(fns)


def timed(op, shape, fn, make, nbytes, sets=None, capturable=False, extra=None, target=None):
    """Time ``fn(**make(i))`` over rotated input sets on Triton (graph) and torch; add a table row."""
    if not S["timing"]:
        return
    k = sets or (1 if nbytes >= L2_BYTES else min(S["max_sets"], math.ceil(2 * L2_BYTES / max(nbytes, 1))))
    kws = [make(i) for i in range(k)]
    row = {"op": op, "shape": shape, "bytes": nbytes, "sets": k, "l2_resident": k * nbytes < L2_BYTES}
    for name, backend, graphable in (("triton", TRI, True), ("baseline", TORCH, capturable)):
        fns = [partial(fn, **kw, backend=backend) for kw in kws]
        for mode, timer in [("graph", graph_us)] * graphable + [("eager", eager_us)]:
            try:  # a torch path that syncs the host cannot be captured: fall back to eager launches
                row[f"{name}_us"], row[f"{name}_mode"] = timer(fns), mode
                break
            except Exception as e:
                row[f"{name}_error"] = repr(e)
    if "triton_us" not in row:
        raise RuntimeError(f"triton timing failed: {row['triton_error']}")
    row["floor_us"] = nbytes / BW["copy"] / 1e3 if BW.get("copy") else None
    row["ratio"] = row["triton_us"] / row["floor_us"] if row["floor_us"] else None
    row["speedup"] = row["baseline_us"] / row["triton_us"] if row.get("baseline_us") else None
    if "ring_counter" in kws[0]:
        row["ring_rows_while_timing"] = int(kws[0]["ring_counter"][0])
    row.update(extra(row) if extra else {})
    if target and S["full"]:
        row["target"] = f"{target[0]} {'PASS' if target[1](row) else 'MISS'}"
    R["timing"].append(row)
    print(f"time      {op} {shape}: triton {row['triton_us']:.2f} µs ({row['triton_mode']}), "
          f"torch {fmt(row.get('baseline_us'), '.1f')} µs ({row.get('baseline_mode')}) "
          f"({k} sets{', L2-resident' if row['l2_resident'] else ''})"
          + (f"; {row['ring_rows_while_timing']} RING ROWS while timing" if row.get("ring_rows_while_timing") else ""),
          flush=True)


def fmt(v, spec, width=0):
    return ("-" if v is None else format(v, spec)).rjust(width)


def copy_bandwidth():
    src = torch.empty(S["copy_bytes"], dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    dst.copy_(src)
    us = median_us(partial(dst.copy_, src), 2, 10)
    BW["copy"] = 2 * src.numel() / us / 1e3
    print(f"bandwidth copy_ of {src.numel() / 2**30:.1f} GiB: {BW['copy']:.0f} GB/s read+written", flush=True)


@triton.jit
def _gather_rows_kernel(buf_ptr, idx_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Lane i reads the 32-byte row idx[i] of an int64[N, 4] buffer and writes its 8-byte sum."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    row = tl.load(idx_ptr + i, mask=m, other=0).to(tl.int64)
    x = tl.load(buf_ptr + row[:, None] * 4 + tl.arange(0, 4)[None, :], mask=m[:, None], other=0)
    tl.store(out_ptr + i, tl.sum(x, 1), mask=m)


def gather_ceiling():
    """Random 32-byte rows gathered from a buffer as large as verify's canary, as many rows as verify
    gathers (record + predecessor), rotated over as many sets as verify: useful GB/s = 32 B per row."""
    groups, bs, ctx = S["world"]
    n_slots, rows = S["num_slots"], 2 * bs * ctx
    buf = torch.empty(n_slots, 4, dtype=torch.int64, device=DEV).random_(generator=GEN)
    idx = [rnd(rows, hi=n_slots, dtype=torch.int32) for _ in range(groups)]
    outs = [torch.empty(rows, 4, dtype=torch.int64, device=DEV) for _ in range(groups)]
    sums = [torch.empty(rows, dtype=torch.int64, device=DEV) for _ in range(groups)]
    t_sel = graph_us([partial(torch.index_select, buf, 0, ix, out=o) for ix, o in zip(idx, outs, strict=True)])
    grid = (triton.cdiv(rows, 1024),)
    t_tri = graph_us([partial(_gather_rows_kernel[grid], buf, ix, o, rows, BLOCK=1024)
                      for ix, o in zip(idx, sums, strict=True)])
    BW["gather_index_select"], BW["gather_triton"] = 32 * rows / t_sel / 1e3, 32 * rows / t_tri / 1e3
    BW["gather"] = max(BW["gather_index_select"], BW["gather_triton"])
    print(f"ceiling   random 32-B gather of {rows} rows from {n_slots}: index_select "
          f"{BW['gather_index_select']:.0f} GB/s, triton {BW['gather_triton']:.0f} GB/s useful", flush=True)


# --- ops ---------------------------------------------------------------------------------

def run_scatter(bs, seg):
    def make(i):
        return dict(flat_in=rnd(bs * seg), offsets=ar(bs + 1, seg), req_pool_indices=perm(bs),
                    pool_out=rnd(bs + 1, seg, dtype=torch.int32),
                    error_flag=torch.zeros(1, dtype=torch.int32, device=DEV))

    n = bs * seg
    cross(f"scatter_req_token_ids {bs}x{seg}", scatter_req_token_ids, make(0), ["pool_out", "error_flag"])
    target = None
    if n >= 1 << 20:
        last = (bs, seg) == (4096, 256)
        target = ("≤1.5×floor" + (" & <21.5µs" if last else ""),
                  lambda r: r["ratio"] is not None and r["ratio"] <= 1.5 and (not last or r["triton_us"] < 21.5))
    timed("scatter", f"{bs}x{seg}", scatter_req_token_ids, make, 12 * n + 16 * bs + 8, target=target)


def run_gather(bs, seg):
    width = 2 * seg

    def make(i):
        return dict(truth=rnd(bs + 1, width, dtype=torch.int32), truth_lens=rnd(bs, lo=0, hi=width + 1),
                    req_pool_indices=perm(bs), prefix_lens=rnd(bs, lo=0, hi=seg + 1), extend_offsets=ar(bs + 1, seg),
                    input_ids=rnd(bs * seg), out=rnd(bs * seg))

    kw = make(0)
    kw["req_pool_indices"][::5] = 0  # padding requests: no truth
    cross(f"gather_expected_tokens {bs}x{seg}", gather_expected_tokens, kw, ["out"])
    timed("gather", f"{bs}x{seg}", gather_expected_tokens, make, 20 * bs * seg, capturable=True)


def new_canary_random(n_slots):
    return torch.empty(n_slots, 32, dtype=torch.uint8, device=DEV).view(torch.int64).random_(
        generator=GEN).view(torch.uint8)


def ring_kw(capacity=4096):
    ring, counter = rec.new_ring(capacity, DEV)
    return dict(ring=ring, ring_counter=counter, stats=rec.new_stats(DEV), tag=TAG)


def run_stamp(canary, bs, n, label):
    """``bs`` requests writing ``n`` tokens each after a random prefix, seeded from a random record
    whose position fits; every rotated set writes its own slots, so replays stay violation-free."""
    order, used, words, ring = perm(canary.shape[0] - 1), [0], rec.record_words(canary), ring_kw()

    def take(k):
        used[0] += k
        if used[0] > order.numel():
            raise RuntimeError(f"{order.numel()} slots are too few for this many rotated stamp sets")
        return order[used[0] - k: used[0]]

    def make(i):
        prefix, seed = rnd(bs, hi=4096), take(bs)
        words[seed, rec.POSITION] = prefix - 1
        return dict(canary=canary, out_cache_loc=take(bs * n), input_ids=rnd(bs * n),
                    positions=prefix.repeat_interleave(n) + ar(n).repeat(bs), req_pool_indices=ar(bs) + 1,
                    prefix_lens=prefix, write_offsets=ar(bs + 1, n), seed=seed, **ring)

    kw = make(0)
    kw["expected_tokens"] = kw["input_ids"].clone()
    kw["expected_tokens"][rnd(max(1, bs * n // 1000), lo=0, hi=bs * n)] += 1  # a few WRITE_TOKEN rows
    cross(f"stamp {label}", stamp, kw, RING_OUTS)
    target = ("<10µs", lambda r: r["triton_us"] < 10) if (bs, n) == (1, 32768) else None
    timed("stamp", label, stamp, make, 56 * bs * n + 64 * bs, target=target)


def make_pool():
    n_slots, (heads, dim) = S["num_slots"], S["kv"]
    bufs = [torch.empty(n_slots, heads, dim, dtype=torch.bfloat16, device=DEV) for _ in range(4)]
    for b in bufs:
        b.view(torch.int16).random_(generator=GEN)
    return [KVSource.from_buffer(b, half=rec.Half(i % 2), layer=i // 2) for i, b in enumerate(bufs)]


def make_world():
    """G groups of bs requests x ctx tokens on distinct slots, stamped clean, with a decode plan
    (and truth) per group for verify."""
    groups, bs, ctx = S["world"]
    n_slots, rows = S["num_slots"], 1 + groups * bs
    canary = new_canary_random(n_slots)
    table = torch.zeros(rows, ctx + 1, dtype=torch.int32, device=DEV)
    table[1:] = perm(n_slots - 1)[: groups * bs * (ctx + 1)].view(groups * bs, ctx + 1).to(torch.int32)
    truth = rnd(rows, ctx + 1, dtype=torch.int32)
    plans = []
    for g in range(groups):
        r = ar(bs) + 1 + g * bs
        kw = dict(canary=canary, out_cache_loc=table[r, :ctx].reshape(-1).long(),
                  input_ids=truth[r, :ctx].reshape(-1).long(), positions=ar(ctx).repeat(bs), req_pool_indices=r,
                  prefix_lens=full_(bs, 0), write_offsets=ar(bs + 1, ctx), seed=full_(bs, -1), **ring_kw())
        if g == 0:
            cross(f"stamp prefill {bs}x{ctx} (verify world)", stamp, kw, RING_OUTS, expect_rows=0)
        stamp(**kw, backend=TRI)
        plans.append(plan_kw(r, ctx, table, truth))
        if g == 0:
            cross(f"build_plan decode bs{bs}@{ctx} with truth", build_plan, plans[0], ["plan"])
        build_plan(**plans[-1], backend=TRI)
    return dict(canary=canary, table=table, truth=truth, plans=[p["plan"] for p in plans])


def plan_kw(rows, ctx, table, truth=None):
    bs = rows.numel()
    return dict(req_pool_indices=rows, prefix_lens=full_(bs, ctx), extend_lens=full_(bs, 1), req_to_token=table,
                plan=Plan.allocate(bs * ctx, bs, DEV), truth=truth,
                truth_lens=None if truth is None else full_(bs, ctx + 1))


def verify_kw(world, plan, src, mode, ring):
    meta = source_meta(src[:2], mode, DEV) if mode is not NONE else None
    return dict(canary=world["canary"], plan=plan, sources=src[:2], mode=mode, meta=meta, **ring)


def run_verify(world, src, mode):
    groups, bs, ctx = S["world"]
    entries = bs * ctx
    cross(f"verify {entries} entries clean {mode.name}", verify, verify_kw(world, world["plans"][0], src, mode,
                                                                             ring_kw()), RING_OUTS, expect_rows=0)
    ring, nbytes = ring_kw(), entries * (80 + (32 if mode is PARTIAL else 0))

    def pct(r):
        useful = r["bytes"] / r["triton_us"] / 1e3
        return {"useful_GBps": useful, "pct_ceiling": 100 * useful / BW["gather"] if BW.get("gather") else None}

    target = ("≥70% gather ceiling", lambda r: (r["pct_ceiling"] or 0) >= 70) if mode is NONE else None
    timed("verify", f"{entries} {mode.name}", verify,
          lambda i: verify_kw(world, world["plans"][i % groups], src, mode, ring), nbytes, sets=groups, extra=pct,
          target=target)


def run_verify_corrupt(world, src, mode):
    """Repoint random page-table entries of group 0 to live slots of other requests and flip the
    first K word of a few slots; both paths must report the same violation rows."""
    _, bs, ctx = S["world"]
    table, rows = world["table"].clone(), world["table"].shape[0]
    n = max(4, bs * ctx // 1000)
    table[rnd(n, hi=bs + 1), rnd(n, lo=0, hi=ctx)] = world["table"][rnd(n, lo=bs + 1, hi=rows), rnd(n, lo=0, hi=ctx)]
    plan = build_plan(**plan_kw(ar(bs) + 1, ctx, table, world["truth"]), backend=TRI)
    kwords = src[0].words.view(S["num_slots"], -1)
    flipped = world["table"][rnd(max(2, n // 5), hi=bs + 1), rnd(max(2, n // 5), lo=0, hi=ctx)].long().unique()
    saved = kwords[flipped, 0].clone()
    kwords[flipped, 0] ^= 1
    try:
        got = cross(f"verify corrupted ({n} entries repointed, {flipped.numel()} K words flipped) {mode.name}",
                    verify, verify_kw(world, plan, src, mode, ring_kw(1 << 16)), RING_OUTS, expect_rows=">0")
    finally:
        kwords[flipped, 0] = saved
    reasons = collections.Counter()
    for row, c in got.items():
        reasons[rec.format_reasons(row[-1])] += c
    R["correctness"][-1]["reasons"] = dict(reasons)
    print(f"          reasons: {dict(reasons)}")


def run_plan(bs, ctx):
    def make(i):
        return plan_kw(perm(bs), ctx, rnd(bs + 1, ctx + 1, hi=S["num_slots"], dtype=torch.int32))

    cross(f"build_plan bs{bs}@{ctx}", build_plan, make(0), ["plan"])
    timed("build_plan", f"bs{bs}@{ctx}", build_plan, make, 24 * bs * ctx)


def run_fingerprint(src, canary, n, mode):
    meta = source_meta(src, mode, DEV)

    def make(i):
        return dict(slots=rnd(n, hi=canary.shape[0]), sources=src, mode=mode, out=rnd(n), canary=canary, meta=meta)

    kw = make(0)
    kw["slots"][:3] = torch.tensor([0, -5, canary.shape[0] + 7])  # invalid slots give 0 and are not recorded
    kw["record"] = True
    cross(f"fingerprint {n} slots x {len(src)} sources {mode.name} (record)", fingerprint, kw, ["out", "canary"])
    nbytes = n * (sum(4 * s.words_read(mode) for s in src) + 16)
    pct = lambda r: {"pct_ceiling": 100 / r["ratio"] if r["ratio"] else None}  # noqa: E731  % of copy bandwidth
    target = ("≥80% copy bw", lambda r: (r["pct_ceiling"] or 0) >= 80) if mode is ALL else None
    timed("fingerprint", f"{n}x{len(src)} {mode.name}", fingerprint, make, nbytes, capturable=True, extra=pct,
          target=target)


# --- report ------------------------------------------------------------------------------

def print_table():
    print(f"{'op':<12}{'shape':<18}{'triton µs':>10}{'floor µs':>10}{'×floor':>8}{'torch µs':>10}{'speed-up':>10}"
          f"{'%ceil':>7}  {'':<3} target")
    for r in R["timing"]:
        print(f"{r['op']:<12}{r['shape']:<18}{r['triton_us']:>10.2f}{fmt(r['floor_us'], '.2f', 10)}"
              f"{fmt(r['ratio'], '.2f', 8)}{fmt(r.get('baseline_us'), '.1f', 10)}{fmt(r['speedup'], '.1f', 10)}"
              f"{fmt(r.get('pct_ceiling'), '.0f', 7)}  {'L2' if r['l2_resident'] else '':<3} {r.get('target', '')}")
    if BW:
        print(f"copy bandwidth {fmt(BW.get('copy'), '.0f')} GB/s (read+written); random 32-B gather ceiling "
              f"{fmt(BW.get('gather'), '.0f')} GB/s useful (index_select {fmt(BW.get('gather_index_select'), '.0f')}, "
              f"triton {fmt(BW.get('gather_triton'), '.0f')}); %ceil: verify vs gather ceiling, fingerprint vs copy")
    ok = sum(c["ok"] for c in R["correctness"])
    print(f"correctness {ok}/{len(R['correctness'])} OK; {len(R['errors'])} section errors"
          + "".join(f"\n  error in {e['section']}: {e['error']}" for e in R["errors"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (implied without CUDA: correctness only)")
    p.add_argument("--check-only", action="store_true", help="correctness only, no timing")
    p.add_argument("--json", default=None, help="write details here (default $OUT/bench_ops.json when OUT is set)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=float, default=400, help="seconds after which timing stops (checks go on)")
    args = p.parse_args(argv)
    S.update(QUICK if args.quick or not CUDA else FULL)
    S.update(timing=CUDA and not args.check_only, t0=time.perf_counter(), budget=args.budget,
             json=args.json or (os.path.join(os.environ["OUT"], "bench_ops.json") if os.environ.get("OUT") else None))
    GEN.manual_seed(args.seed)
    R["meta"] = {"device": torch.cuda.get_device_name() if CUDA else "cpu (TRITON_INTERPRET=1)",
                 "torch": torch.__version__, "triton": triton.__version__, "args": vars(args),
                 "shapes": {k: v for k, v in S.items()}}
    print(f"device {R['meta']['device']}; torch {torch.__version__}, triton {triton.__version__}; "
          f"{'full' if S['full'] else 'quick'} shapes; timing {'on' if S['timing'] else 'off'}", flush=True)
    if S["timing"]:
        with section("copy bandwidth"):
            copy_bandwidth()
        with section("gather ceiling"):
            gather_ceiling()
    for bs, seg in S["scatter"]:
        with section(f"scatter {bs}x{seg}"):
            run_scatter(bs, seg)
    with section("gather"):
        run_gather(*S["gather"])
    with section("stamp canary"):
        canary = new_canary_random(S["num_slots"])
    for n in S["stamp"]:
        with section(f"stamp 1x{n}"):
            run_stamp(canary, 1, n, f"1x{n}")
    with section(f"stamp decode {S['decode_bs']}x1"):
        run_stamp(canary, S["decode_bs"], 1, f"{S['decode_bs']}x1 decode")
    with section("kv pool"):
        src = make_pool()
    with section("verify world"):
        world = make_world()
    with section("verify world fingerprints"):  # PARTIAL fingerprints of layer 0's K and V, for verify PARTIAL
        slots = world["table"][1:, :S["world"][2]].reshape(-1).long()
        fingerprint(slots=slots, sources=src[:2], mode=PARTIAL, canary=world["canary"], record=True, backend=TRI)
    for mode in (NONE, PARTIAL):
        with section(f"verify {mode.name}"):
            run_verify(world, src, mode)
    for mode in (NONE, PARTIAL):
        with section(f"verify corrupted {mode.name}"):
            run_verify_corrupt(world, src, mode)
    world = None  # frees the verify world
    _, bs, ctx = S["world"]
    for shape in ((bs, ctx), (1, S["plan_long"])):
        with section(f"build_plan bs{shape[0]}@{shape[1]}"):
            run_plan(*shape)
    for mode in (ALL, PARTIAL):
        with section(f"fingerprint {mode.name}"):
            run_fingerprint(src, canary, S["fp_slots"], mode)
    save()
    print(f"\nelapsed {R['meta']['elapsed_s']} s" + (f"; details in {S['json']}" if S["json"] else ""))
    print_table()
    return 0 if not R["errors"] and all(c["ok"] for c in R["correctness"]) else 1


if __name__ == "__main__":
    sys.exit(main())
