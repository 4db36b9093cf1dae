"""Kernel microbenchmarks: cross-check and time scatter, gather, build_plan, stamp, verify, fingerprint.

1. correctness: where Triton can run (CUDA, or the CPU under ``TRITON_INTERPRET=1``), the kernel
   and the torch path run on the same random inputs; every output buffer is compared element for
   element, ring rows as a multiset (kernels append them in any order);
2. timing: on CUDA each Triton launch is captured in a CUDA graph; median µs per launch from CUDA
   events around batches of replays, beside the torch path on the same device (graph-captured
   where it has no host sync, else eager). Inputs smaller than L2 rotate over independent sets
   (one graph launches each set once) so launches read HBM; rows still L2-resident are marked
   "L2". On the CPU the torch path is timed eagerly with ``perf_counter``;
3. floor: bytes the op must move / copy bandwidth measured in the same run; verify is also put
   against a random 32-byte gather ceiling, fingerprint ALL against the copy bandwidth.

The op cases and ``run_ops`` live in ``bench/op_cases.py``; this module holds the harness and the table.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
from functools import partial

import torch

from kvcanary.bench import timing
from kvcanary.bench.results import RunRecord, fmt
from kvcanary.core import record as rec
from kvcanary.ops.backend import HAS_TRITON, Backend, tl, triton
from kvcanary.ops.plan import Plan
from kvcanary.ops.state import DeviceState

TRI, TORCH = Backend.TRITON, Backend.TORCH
L2_BYTES = 60e6
RING_OUTS = ["state"]  # records, ring rows, counter and stats
# shapes: the target shapes on CUDA; a CPU-sized set; tiny shapes that run in seconds on the CPU
SHAPES = {
    "full": dict(scatter=[(1, 128), (64, 2048), (256, 8192), (1024, 4096), (4096, 256)], gather=(256, 8192),
                 stamp=[1, 512, 4096, 32768], decode_bs=256, num_slots=1 << 22, world=(3, 256, 4096),
                 plan_long=32768, kv=(8, 128), fp_slots=32768, max_sets=128, copy_bytes=4 << 30),
    "cpu": dict(scatter=[(1, 128), (64, 2048), (256, 4096)], gather=(64, 2048), stamp=[1, 512, 4096, 32768],
                decode_bs=256, num_slots=1 << 17, world=(2, 32, 1024), plan_long=32768, kv=(8, 128), fp_slots=8192,
                max_sets=1, copy_bytes=256 << 20),
    "quick": dict(scatter=[(1, 128), (5, 40)], gather=(3, 50), stamp=[1, 40, 1500], decode_bs=6, num_slots=1 << 14,
                  world=(2, 4, 64), plan_long=300, kv=(2, 8), fp_slots=100, max_sets=2, copy_bytes=32 << 20),
}


def triton_runs_on(device: torch.device) -> bool:
    """Triton kernels run on CUDA, and on CPU tensors only under the interpreter (set before import)."""
    return HAS_TRITON and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


@triton.jit
def _gather_rows_kernel(buf_ptr, idx_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Lane i reads the 32-byte row idx[i] of an int64[N, 4] buffer and writes its 8-byte sum."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    row = tl.load(idx_ptr + i, mask=m, other=0).to(tl.int64)
    x = tl.load(buf_ptr + row[:, None] * 4 + tl.arange(0, 4)[None, :], mask=m[:, None], other=0)
    tl.store(out_ptr + i, tl.sum(x, 1), mask=m)


def gather_rows_launchers(buf, idx, rows):
    """One launch of the random-row gather kernel per index set (the gather ceiling on CUDA)."""
    sums = [torch.empty(rows, dtype=torch.int64, device=buf.device) for _ in idx]
    grid = (triton.cdiv(rows, 1024),)
    return [partial(_gather_rows_kernel[grid], buf, ix, o, rows, BLOCK=1024) for ix, o in zip(idx, sums, strict=True)]


class OpsBench:
    """One run of the op microbenchmarks on ``device``; results in ``record.data``."""

    def __init__(self, device: torch.device, shapes: str, record: RunRecord, *, timing_on: bool = True,
                 seed: int = 0):
        self.dev, self.record = device, record
        self.s = dict(SHAPES[shapes], name=shapes)
        self.cuda = device.type == "cuda"
        self.triton = triton_runs_on(device)
        self.timing = timing_on
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.bw: dict = {}  # GB/s: copy (read+written), gather (useful bytes of random 32-byte rows)
        record.data.update(correctness=[], timing=[], bandwidth_GBps=self.bw)

    # --- random inputs ---------------------------------------------------------------------

    def rnd(self, *shape, lo=1, hi=2**31 - 1, dtype=torch.int64):
        """Random integers in [lo, hi): inputs are never zeros unless lo is 0."""
        return torch.randint(lo, hi, shape, generator=self.gen, device=self.dev, dtype=dtype)

    def perm(self, n):
        """A random permutation of 1..n (distinct rows or slots, none of them the reserved 0)."""
        return torch.randperm(n, generator=self.gen, device=self.dev) + 1

    def ar(self, n, scale=1):
        return torch.arange(n, device=self.dev) * scale

    def full_(self, n, value):
        return torch.full((n,), value, dtype=torch.int64, device=self.dev)

    def ring_kw(self, canary, capacity=4096):
        """``state`` over ``canary`` with a fresh ring and stats, and a HEAD tag."""
        ring, counter = rec.new_ring(capacity, self.dev)
        return dict(state=DeviceState(canary, ring, counter, rec.new_stats(self.dev)),
                    tag=rec.LaunchTag(rec.LaunchPoint.HEAD).value)

    # --- correctness -----------------------------------------------------------------------

    def cross(self, name, op, kw, outs, expect_rows=None):
        """Run ``op`` on Triton and on torch, each on its own copy of ``outs``; compare them all.
        Where Triton cannot run, runs the torch path once on a copy, unchecked."""
        a, b = ({k: _clone(v) if k in outs else v for k, v in kw.items()} for _ in range(2))
        if not self.triton:
            op(**b, backend=TORCH)  # on copies, like the cross-check: the inputs stay as made
            return None
        op(**a, backend=TRI)
        op(**b, backend=TORCH)
        problems, names = [], []
        for key in outs:
            for (label, x), (_, y) in zip(_tensors(key, a[key]), _tensors(key, b[key]), strict=True):
                names.append(label)
                x, y = x.reshape(-1), y.reshape(-1).to(x.device)
                diff = (x != y).nonzero().flatten()
                if diff.numel():
                    problems.append(f"{label}: {diff.numel()} of {x.numel()} differ, first at {diff[:5].tolist()}")
        rows = got = None
        if "state" in outs:
            got, other = (collections.Counter(map(tuple, st.ring[: min(int(st.ring_counter[0]),
                                                                        len(st.ring))].tolist()))
                          for st in (a["state"], b["state"]))
            rows = sum(got.values())
            if got != other:
                problems.append(f"ring rows: {sum((got - other).values())} only from triton, "
                                f"{sum((other - got).values())} only from torch")
            if (expect_rows == 0 and rows) or (expect_rows == ">0" and not rows):
                problems.append(f"{rows} violation rows, expected {expect_rows}")
            names.append(f"ring ({rows} rows)")
        ok = not problems
        self.record.data["correctness"].append({"name": name, "ok": ok, "compared": names, "problems": problems,
                                                "ring_rows": rows})
        print(f"{'OK' if ok else 'MISMATCH':<9} {name}: " + ("; ".join(problems) if problems else ", ".join(names)),
              flush=True)
        return got

    # --- timing ----------------------------------------------------------------------------

    def timed(self, op, shape, fn, make, nbytes, sets=None, capturable=False, extra=None, target=None):
        """Time ``fn(**make(i))`` over rotated input sets: on CUDA Triton (graph) and the torch path;
        on the CPU the torch path. Adds a table row."""
        if not self.timing:
            return
        if self.record.over_budget:
            self.timing = False
            print(f"time budget of {self.record.budget_s} s spent: timing off from here, correctness only", flush=True)
            return
        if not self.cuda:
            sets = 1
        k = sets or (1 if nbytes >= L2_BYTES else min(self.s["max_sets"], math.ceil(2 * L2_BYTES / max(nbytes, 1))))
        kws = [make(i) for i in range(k)]
        row = {"op": op, "shape": shape, "bytes": nbytes, "sets": k,
               "l2_resident": self.cuda and k * nbytes < L2_BYTES}
        paths = [("main", TRI, True), ("baseline", TORCH, capturable)] if self.cuda else [("main", TORCH, False)]
        for name, backend, graphable in paths:
            fns = [partial(fn, **kw, backend=backend) for kw in kws]
            timers = [("graph", timing.graph_us)] * graphable + [("eager", partial(timing.eager_us, device=self.dev))]
            for mode, timer in timers:
                try:  # a torch path that syncs the host cannot be captured: fall back to eager launches
                    row[f"{name}_us"], row[f"{name}_mode"] = timer(fns), mode
                    row[f"{name}_path"] = backend.value
                    break
                except Exception as e:  # noqa: BLE001 - recorded in the row
                    row[f"{name}_error"] = repr(e)
        if "main_us" not in row:
            raise RuntimeError(f"{op} {shape}: timing failed: {row['main_error']}")
        row["floor_us"] = timing.floor_us(nbytes, self.bw["copy"]) if self.bw.get("copy") else None
        row["ratio"] = row["main_us"] / row["floor_us"] if row["floor_us"] else None
        row["speedup"] = row["baseline_us"] / row["main_us"] if row.get("baseline_us") else None
        if "state" in kws[0]:
            row["ring_rows_while_timing"] = int(kws[0]["state"].ring_counter[0])
        row.update(extra(row) if extra else {})
        if target and self.s["name"] == "full" and self.cuda:
            row["target"] = f"{target[0]} {'PASS' if target[1](row) else 'MISS'}"
        self.record.data["timing"].append(row)
        print(f"time      {op} {shape}: {row['main_path']} {row['main_us']:.2f} µs ({row['main_mode']})"
              + (f", torch {fmt(row.get('baseline_us'), '.1f')} µs ({row.get('baseline_mode')})" if self.cuda else "")
              + f" ({k} sets{', L2-resident' if row['l2_resident'] else ''})"
              + (f"; {row['ring_rows_while_timing']} RING ROWS while timing" if row.get("ring_rows_while_timing")
                 else ""), flush=True)

    def copy_bandwidth(self):
        self.bw["copy"] = timing.copy_bandwidth(self.dev, self.s["copy_bytes"])
        print(f"bandwidth copy_ of {self.s['copy_bytes'] / 2**30:.2f} GiB: {self.bw['copy']:.0f} GB/s read+written",
              flush=True)

    def gather_ceiling(self):
        """Random 32-byte rows gathered from a buffer as large as verify's canary, as many rows as
        verify gathers (record + predecessor), rotated over as many sets as verify: useful GB/s =
        32 B per row. index_select everywhere; a Triton gather on CUDA."""
        groups, bs, ctx = self.s["world"]
        n_slots, rows = self.s["num_slots"], 2 * bs * ctx
        buf = torch.empty(n_slots, 4, dtype=torch.int64, device=self.dev).random_(generator=self.gen)
        idx = [self.rnd(rows, hi=n_slots, dtype=torch.int32) for _ in range(groups)]
        outs = [torch.empty(rows, 4, dtype=torch.int64, device=self.dev) for _ in range(groups)]
        sel = [partial(torch.index_select, buf, 0, ix, out=o) for ix, o in zip(idx, outs, strict=True)]
        t_sel = timing.graph_us(sel) if self.cuda else timing.eager_us(sel, self.dev)
        self.bw["gather_index_select"] = 32 * rows / t_sel / 1e3
        self.bw["gather"] = self.bw["gather_index_select"]
        if self.cuda:
            t_tri = timing.graph_us(gather_rows_launchers(buf, idx, rows))
            self.bw["gather_triton"] = 32 * rows / t_tri / 1e3
            self.bw["gather"] = max(self.bw["gather"], self.bw["gather_triton"])
        print(f"ceiling   random 32-B gather of {rows} rows from {n_slots}: index_select "
              f"{self.bw['gather_index_select']:.0f} GB/s, triton {fmt(self.bw.get('gather_triton'), '.0f')} GB/s "
              "useful", flush=True)

    # --- report ----------------------------------------------------------------------------

    def print_table(self):
        main, base = ("triton µs", "torch µs") if self.cuda else ("torch µs", "")
        print(f"{'op':<12}{'shape':<18}{main:>10}{'floor µs':>10}{'×floor':>10}{base:>10}{'speed-up':>10}"
              f"{'%ceil':>7}  {'':<3} target")
        for r in self.record.data["timing"]:
            print(f"{r['op']:<12}{r['shape']:<18}{r['main_us']:>10.2f}{fmt(r['floor_us'], '.2f', 10)}"
                  f"{fmt(r['ratio'], '.2f', 10)}{fmt(r.get('baseline_us'), '.1f', 10)}{fmt(r['speedup'], '.1f', 10)}"
                  f"{fmt(r.get('pct_ceiling'), '.0f', 7)}  {'L2' if r['l2_resident'] else '':<3} {r.get('target', '')}")
        bw = self.bw
        if bw:
            print(f"copy bandwidth {fmt(bw.get('copy'), '.0f')} GB/s (read+written); random 32-B gather ceiling "
                  f"{fmt(bw.get('gather'), '.0f')} GB/s useful (index_select "
                  f"{fmt(bw.get('gather_index_select'), '.0f')}, triton {fmt(bw.get('gather_triton'), '.0f')}); "
                  "%ceil: verify vs gather ceiling, fingerprint vs copy")
        if not self.cuda and self.timing:
            print("CPU: the torch path timed eagerly with perf_counter (no CUDA graphs); floors from the CPU copy")
        checks = self.record.data["correctness"]
        ok = sum(c["ok"] for c in checks)
        print(f"correctness {ok}/{len(checks)} OK" + ("" if self.triton else " (Triton not runnable here: no "
                                                       "cross-checks; set TRITON_INTERPRET=1 before the first import)")
              + f"; {len(self.record.errors)} section errors"
              + "".join(f"\n  error in {e['section']}: {e['error']}" for e in self.record.errors))

    @property
    def passed(self) -> bool:
        return not self.record.errors and all(c["ok"] for c in self.record.data["correctness"])


def _tensors(name, v):
    if isinstance(v, Plan):
        return [(f"{name}.{f.name}", getattr(v, f.name)) for f in dataclasses.fields(v)]
    if isinstance(v, DeviceState):  # ring rows are compared as a multiset (their order is unspecified)
        return [(f"{name}.records", v.records), (f"{name}.ring_counter", v.ring_counter), (f"{name}.stats", v.stats)]
    return [(name, v)]


def _clone(v):
    if isinstance(v, Plan):
        return Plan(*[t.clone() for _, t in _tensors("", v)])
    if isinstance(v, DeviceState):
        return DeviceState(v.records.clone(), v.ring.clone(), v.ring_counter.clone(), v.stats.clone())
    return v.clone()
