"""The op cases of the kernel microbenchmarks (harness in ``bench/ops.py``).

Each case builds random inputs, cross-checks Triton against the torch path where Triton runs,
then times the op at that shape with its bytes-moved floor and, at the issue's target shapes,
marks the target met or missed.
"""

from __future__ import annotations

import collections

import torch

from kvcanary.bench import timing
from kvcanary.bench.ops import RING_OUTS, OpsBench, triton_runs_on
from kvcanary.bench.results import RunRecord
from kvcanary.core import record as rec
from kvcanary.ops.backend import HAS_TRITON
from kvcanary.ops.fingerprint import FingerprintMode, KVSource, fingerprint, source_meta
from kvcanary.ops.gather import gather_expected_tokens
from kvcanary.ops.plan import Plan, build_plan
from kvcanary.ops.scatter import scatter_req_token_ids
from kvcanary.ops.stamp import stamp
from kvcanary.ops.verify import verify

NONE, PARTIAL, ALL = FingerprintMode.NONE, FingerprintMode.PARTIAL, FingerprintMode.ALL


def run_scatter(b: OpsBench, bs, seg):
    def make(i):
        return dict(flat_in=b.rnd(bs * seg), offsets=b.ar(bs + 1, seg), req_pool_indices=b.perm(bs),
                    pool_out=b.rnd(bs + 1, seg, dtype=torch.int32),
                    error_flag=torch.zeros(1, dtype=torch.int32, device=b.dev))

    n = bs * seg
    b.cross(f"scatter_req_token_ids {bs}x{seg}", scatter_req_token_ids, make(0), ["pool_out", "error_flag"])
    target = None
    if n >= 1 << 20:
        last = (bs, seg) == (4096, 256)
        target = ("≤1.5×floor" + (" & <21.5µs" if last else ""),
                  lambda r: r["ratio"] is not None and r["ratio"] <= 1.5 and (not last or r["main_us"] < 21.5))
    b.timed("scatter", f"{bs}x{seg}", scatter_req_token_ids, make, 12 * n + 16 * bs + 8, target=target)


def run_gather(b: OpsBench, bs, seg):
    width = 2 * seg

    def make(i):
        return dict(truth=b.rnd(bs + 1, width, dtype=torch.int32), truth_lens=b.rnd(bs, lo=0, hi=width + 1),
                    req_pool_indices=b.perm(bs), prefix_lens=b.rnd(bs, lo=0, hi=seg + 1),
                    extend_offsets=b.ar(bs + 1, seg), input_ids=b.rnd(bs * seg), out=b.rnd(bs * seg))

    kw = make(0)
    kw["req_pool_indices"][::5] = 0  # padding requests: no truth
    b.cross(f"gather_expected_tokens {bs}x{seg}", gather_expected_tokens, kw, ["out"])
    b.timed("gather", f"{bs}x{seg}", gather_expected_tokens, make, 20 * bs * seg, capturable=True)


def new_canary_random(b: OpsBench, n_slots):
    return torch.empty(n_slots, 32, dtype=torch.uint8, device=b.dev).view(torch.int64).random_(
        generator=b.gen).view(torch.uint8)


def run_stamp(b: OpsBench, canary, bs, n, label):
    """``bs`` requests writing ``n`` tokens each after a random prefix, seeded from a random record
    whose position fits; every rotated set writes its own slots, so replays stay violation-free."""
    order, used, words, ring = b.perm(canary.shape[0] - 1), [0], rec.record_words(canary), b.ring_kw(canary)

    def take(k):
        used[0] += k
        if used[0] > order.numel():
            raise RuntimeError(f"{order.numel()} slots are too few for this many rotated stamp sets")
        return order[used[0] - k: used[0]]

    def make(i):
        prefix, seed = b.rnd(bs, hi=4096), take(bs)
        words[seed, rec.POSITION] = prefix - 1
        return dict(out_cache_loc=take(bs * n), input_ids=b.rnd(bs * n),
                    positions=prefix.repeat_interleave(n) + b.ar(n).repeat(bs), req_pool_indices=b.ar(bs) + 1,
                    prefix_lens=prefix, write_offsets=b.ar(bs + 1, n), seed=seed, **ring)

    kw = make(0)
    kw["expected_tokens"] = kw["input_ids"].clone()
    kw["expected_tokens"][b.rnd(max(1, bs * n // 1000), lo=0, hi=bs * n)] += 1  # a few WRITE_TOKEN rows
    b.cross(f"stamp {label}", stamp, kw, RING_OUTS)
    target = ("<10µs", lambda r: r["main_us"] < 10) if (bs, n) == (1, 32768) else None
    b.timed("stamp", label, stamp, make, 56 * bs * n + 64 * bs, target=target)


def make_pool(b: OpsBench):
    n_slots, (heads, dim) = b.s["num_slots"], b.s["kv"]
    bufs = [torch.empty(n_slots, heads, dim, dtype=torch.bfloat16, device=b.dev) for _ in range(4)]
    for buf in bufs:
        buf.view(torch.int16).random_(generator=b.gen)
    return [KVSource.from_buffer(buf, half=rec.Half(i % 2), layer=i // 2) for i, buf in enumerate(bufs)]


def plan_kw(b: OpsBench, rows, ctx, table, truth=None):
    bs = rows.numel()
    return dict(req_pool_indices=rows, prefix_lens=b.full_(bs, ctx), extend_lens=b.full_(bs, 1), req_to_token=table,
                plan=Plan.allocate(bs * ctx, bs, b.dev), truth=truth,
                truth_lens=None if truth is None else b.full_(bs, ctx + 1))


def make_world(b: OpsBench):
    """G groups of bs requests x ctx tokens on distinct slots, stamped clean, with a decode plan
    (and truth) per group for verify."""
    groups, bs, ctx = b.s["world"]
    n_slots, rows = b.s["num_slots"], 1 + groups * bs
    canary = new_canary_random(b, n_slots)
    table = torch.zeros(rows, ctx + 1, dtype=torch.int32, device=b.dev)
    table[1:] = b.perm(n_slots - 1)[: groups * bs * (ctx + 1)].view(groups * bs, ctx + 1).to(torch.int32)
    truth = b.rnd(rows, ctx + 1, dtype=torch.int32)
    plans = []
    for g in range(groups):
        r = b.ar(bs) + 1 + g * bs
        kw = dict(out_cache_loc=table[r, :ctx].reshape(-1).long(),
                  input_ids=truth[r, :ctx].reshape(-1).long(), positions=b.ar(ctx).repeat(bs), req_pool_indices=r,
                  prefix_lens=b.full_(bs, 0), write_offsets=b.ar(bs + 1, ctx), seed=b.full_(bs, -1),
                  **b.ring_kw(canary))
        if g == 0:
            b.cross(f"stamp prefill {bs}x{ctx} (verify world)", stamp, kw, RING_OUTS, expect_rows=0)
        stamp(**kw)
        plans.append(plan_kw(b, r, ctx, table, truth))
        if g == 0:
            b.cross(f"build_plan decode bs{bs}@{ctx} with truth", build_plan, plans[0], ["plan"])
        build_plan(**plans[-1])
    return dict(canary=canary, table=table, truth=truth, plans=[p["plan"] for p in plans])


def verify_kw(world, plan, src, mode, ring):
    meta = source_meta(src[:2], mode, plan.slot.device) if mode is not NONE else None
    return dict(plan=plan, sources=src[:2], mode=mode, meta=meta, **ring)


def run_verify(b: OpsBench, world, src, mode):
    groups, bs, ctx = b.s["world"]
    entries = bs * ctx
    b.cross(f"verify {entries} entries clean {mode.name}", verify,
            verify_kw(world, world["plans"][0], src, mode, b.ring_kw(world["canary"])), RING_OUTS, expect_rows=0)
    ring, nbytes = b.ring_kw(world["canary"]), entries * (80 + (32 if mode is PARTIAL else 0))

    def pct(r):
        useful = r["bytes"] / r["main_us"] / 1e3
        return {"useful_GBps": useful, "pct_ceiling": 100 * useful / b.bw["gather"] if b.bw.get("gather") else None}

    target = ("≥70% gather ceiling", lambda r: (r["pct_ceiling"] or 0) >= 70) if mode is NONE else None
    b.timed("verify", f"{entries} {mode.name}", verify,
            lambda i: verify_kw(world, world["plans"][i % groups], src, mode, ring), nbytes, sets=groups, extra=pct,
            target=target)


def run_verify_corrupt(b: OpsBench, world, src, mode):
    """Repoint random page-table entries of group 0 to live slots of other requests and flip the
    first K word of a few slots; both paths must report the same violation rows."""
    _, bs, ctx = b.s["world"]
    table, rows = world["table"].clone(), world["table"].shape[0]
    n = max(4, bs * ctx // 1000)
    table[b.rnd(n, hi=bs + 1), b.rnd(n, lo=0, hi=ctx)] = \
        world["table"][b.rnd(n, lo=bs + 1, hi=rows), b.rnd(n, lo=0, hi=ctx)]
    plan = build_plan(**plan_kw(b, b.ar(bs) + 1, ctx, table, world["truth"]))
    kwords = src[0].words.view(b.s["num_slots"], -1)
    flipped = world["table"][b.rnd(max(2, n // 5), hi=bs + 1), b.rnd(max(2, n // 5), lo=0, hi=ctx)].long().unique()
    saved = kwords[flipped, 0].clone()
    kwords[flipped, 0] ^= 1
    try:
        got = b.cross(f"verify corrupted ({n} entries repointed, {flipped.numel()} K words flipped) {mode.name}",
                      verify, verify_kw(world, plan, src, mode, b.ring_kw(world["canary"], 1 << 16)), RING_OUTS,
                      expect_rows=">0")
    finally:
        kwords[flipped, 0] = saved
    if got is None:
        return
    reasons = collections.Counter()
    for row, c in got.items():
        reasons[rec.format_reasons(row[-1])] += c
    b.record.data["correctness"][-1]["reasons"] = dict(reasons)
    print(f"          reasons: {dict(reasons)}")


def run_plan(b: OpsBench, bs, ctx):
    def make(i):
        return plan_kw(b, b.perm(bs), ctx, b.rnd(bs + 1, ctx + 1, hi=b.s["num_slots"], dtype=torch.int32))

    b.cross(f"build_plan bs{bs}@{ctx}", build_plan, make(0), ["plan"])
    b.timed("build_plan", f"bs{bs}@{ctx}", build_plan, make, 24 * bs * ctx)


def run_fingerprint(b: OpsBench, src, canary, n, mode):
    meta = source_meta(src, mode, b.dev)
    state = b.ring_kw(canary, 1)["state"]

    def make(i):
        return dict(slots=b.rnd(n, hi=canary.shape[0]), sources=src, mode=mode, out=b.rnd(n), state=state,
                    meta=meta)

    kw = make(0)
    kw["slots"][:3] = torch.tensor([0, -5, canary.shape[0] + 7])  # invalid slots give 0 and are not recorded
    kw["record"] = True
    b.cross(f"fingerprint {n} slots x {len(src)} sources {mode.name} (record)", fingerprint, kw, ["out", "state"])
    nbytes = n * (sum(4 * s.words_read(mode) for s in src) + 16)
    pct = lambda r: {"pct_ceiling": 100 / r["ratio"] if r["ratio"] else None}  # noqa: E731  % of copy bandwidth
    target = ("≥80% copy bw", lambda r: (r["pct_ceiling"] or 0) >= 80) if mode is ALL else None
    b.timed("fingerprint", f"{n}x{len(src)} {mode.name}", fingerprint, make, nbytes, capturable=True, extra=pct,
            target=target)


def run_cases(b: OpsBench) -> None:
    """Every case in order; each in its own section, so one failure does not lose the rest."""
    sec = b.record.section
    if b.timing:
        with sec("copy bandwidth"):
            b.copy_bandwidth()
        with sec("gather ceiling"):
            if b.cuda and not HAS_TRITON:
                raise RuntimeError("triton is not installed: no gather ceiling")
            b.gather_ceiling()
    for bs, seg in b.s["scatter"]:
        with sec(f"scatter {bs}x{seg}"):
            run_scatter(b, bs, seg)
    with sec("gather"):
        run_gather(b, *b.s["gather"])
    canary = None
    with sec("stamp canary"):
        canary = new_canary_random(b, b.s["num_slots"])
    for n in b.s["stamp"]:
        with sec(f"stamp 1x{n}"):
            run_stamp(b, canary, 1, n, f"1x{n}")
    with sec(f"stamp decode {b.s['decode_bs']}x1"):
        run_stamp(b, canary, b.s["decode_bs"], 1, f"{b.s['decode_bs']}x1 decode")
    src = world = None
    with sec("kv pool"):
        src = make_pool(b)
    with sec("verify world"):
        world = make_world(b)
    with sec("verify world fingerprints"):  # PARTIAL fingerprints of layer 0's K and V, for verify PARTIAL
        slots = world["table"][1:, :b.s["world"][2]].reshape(-1).long()
        fingerprint(slots=slots, sources=src[:2], mode=PARTIAL, state=b.ring_kw(world["canary"], 1)["state"],
                    record=True)
    for mode in (NONE, PARTIAL):
        with sec(f"verify {mode.name}"):
            run_verify(b, world, src, mode)
    for mode in (NONE, PARTIAL):
        with sec(f"verify corrupted {mode.name}"):
            run_verify_corrupt(b, world, src, mode)
    world = None  # frees the verify world
    _, bs, ctx = b.s["world"]
    for shape in ((bs, ctx), (1, b.s["plan_long"])):
        with sec(f"build_plan bs{shape[0]}@{shape[1]}"):
            run_plan(b, *shape)
    for mode in (ALL, PARTIAL):
        with sec(f"fingerprint {mode.name}"):
            run_fingerprint(b, src, canary, b.s["fp_slots"], mode)


def run_ops(device: torch.device, *, quick: bool = False, json_path=None, check_only: bool = False, seed: int = 0,
            budget_s: float = 400.0) -> dict:
    """Run every op case on ``device`` (shapes: full on CUDA, CPU-sized on the CPU, tiny with
    ``quick``), print the table last, write JSON to ``json_path`` as it goes; returns the data
    with ``passed`` set (no section error, every cross-check equal)."""
    shapes = "quick" if quick else ("full" if device.type == "cuda" else "cpu")
    meta = timing.environment(device) | {"shapes": shapes, "seed": seed, "check_only": check_only,
                                         "triton_cross_checks": triton_runs_on(device)}
    record = RunRecord(json_path, meta, budget_s)
    bench = OpsBench(device, shapes, record, timing_on=not check_only, seed=seed)
    record.data["meta"]["shape_set"] = {k: v for k, v in bench.s.items()}
    print(f"device {meta['device_name']}; torch {meta['torch']}, triton {meta['triton']}; {shapes} shapes; timing "
          f"{'on' if bench.timing else 'off'}; Triton cross-checks {'on' if bench.triton else 'off'}", flush=True)
    run_cases(bench)
    record.data["passed"] = bench.passed
    record.save()
    print(f"\nelapsed {record.data['meta']['elapsed_s']} s" + (f"; details in {json_path}" if json_path else ""))
    bench.print_table()
    return record.data
