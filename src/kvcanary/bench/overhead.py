"""The overhead study: the canary's device time per step over the bandwidth floor of the step it protects.

For each step shape (``bench/floors.py``) and each mode, a synthetic step of an 8B-shaped model
is built: a page table of random distinct slots over one pool, a ``ForwardBatch``, a ``Canary``
with KV sources over real bf16 K/V buffers of the covered layers. The prefix is first written
through the canary itself (HEAD stamps and marks, the step's K/V writes land, TAIL records
fingerprints) so the timed step takes the real clean path; then the device half of HEAD, the
step's K/V writes into the covered buffers and TAIL (``canary.launch_head(step); write;
canary.tail(step)``) are captured in one CUDA graph and replayed (median µs, CUDA events around
batches of replays), and the writes alone are timed the same way and subtracted (they are the
model's work: TAIL requires them, ``ops.landed``); with truth checks on, the token-history
scatter of ``prepare_head``, which an engine runs outside its graph, is timed on its own and
added. On the CPU eager calls are
timed with ``perf_counter``. Every timed step must report zero violations, and a tripwire
afterwards (one corrupted prefix slot, one eager step) must report one, so the timed path is
known to check.

| mode      | real-KV | truth | sweep             | per-step canary time                     |
|-----------|---------|-------|-------------------|------------------------------------------|
| identity  | none    | off   | -                 | HEAD + TAIL                              |
| partial   | partial | off   | -                 | HEAD + TAIL                              |
| all       | all     | off   | -                 | HEAD + TAIL                              |
| sweep64   | partial | off   | every 64, budget  | HEAD + TAIL + sweep / 64                 |
| sweep8    | partial | off   | every 8, budget   | HEAD + TAIL + sweep / 8                  |
| truth     | partial | on    | -                 | truth scatter + HEAD (+ gather) + TAIL   |
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from kvcanary.bench import timing
from kvcanary.bench.floors import (
    CPU_SHAPES,
    MODEL_8B,
    QUICK_SHAPES,
    REFERENCE_NOTE,
    STUDY_SHAPES,
    ModelShape,
    StepShape,
    reference_pct,
)
from kvcanary.bench.results import RunRecord, fmt
from kvcanary.config import CanaryConfig, Policy
from kvcanary.core.record import (
    CHAIN,
    STAT_CHECKED,
    STAT_STAMPED,
    Half,
    LaunchPoint,
    decode_rows,
    format_reasons,
    record_words,
)
from kvcanary.ops.fingerprint import FingerprintMode, KVSource
from kvcanary.ops.verify import verify
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.canary import Canary, PoolGeometry
from kvcanary.runtime.sweep import SweepRun

TARGET_PCT = 0.2
VOCAB = 128256
EXTRA_BYTES_PER_SLOT = 200  # canary record, plan entry, page table, tokens, batch tensors: generous
CPU_MEMORY_BYTES = 2 << 30  # the CPU study keeps its K/V buffers under this (a shared machine)


@dataclass(frozen=True)
class StudyMode:
    name: str
    label: str
    real_kv: FingerprintMode
    truth: bool = False
    sweep_interval: int = 0
    has_target: bool = False


MODES = (
    StudyMode("identity", "identity only (real-KV none)", FingerprintMode.NONE, has_target=True),
    StudyMode("partial", "+ real-KV partial", FingerprintMode.PARTIAL, has_target=True),
    StudyMode("all", "+ real-KV all", FingerprintMode.ALL),
    StudyMode("sweep64", "partial + sweep every 64 steps", FingerprintMode.PARTIAL, sweep_interval=64),
    StudyMode("sweep8", "partial + sweep every 8 steps", FingerprintMode.PARTIAL, sweep_interval=8),
    StudyMode("truth", "partial + truth checks", FingerprintMode.PARTIAL, truth=True),
)


class Pool:
    """One KV pool shared by every shape: ``num_slots`` slots and real bf16 K/V buffers
    ``[num_slots, kv_heads, head_dim]`` for each covered (layer, half), random bits."""

    def __init__(self, model: ModelShape, num_slots: int, layers: tuple[int, ...], device, gen):
        self.model, self.num_slots, self.layers, self.device, self.gen = model, num_slots, layers, device, gen
        self.sources, self.buffers = [], []
        for layer in layers:
            for half in (Half.K, Half.V):
                buf = torch.empty(num_slots, model.num_kv_heads, model.head_dim, dtype=torch.bfloat16, device=device)
                buf.view(torch.int16).random_(generator=gen)
                self.buffers.append(buf)
                self.sources.append(KVSource.from_buffer(buf, half=half, layer=layer))
        # what the model writes into each written slot: one fresh row (rows may repeat; a check compares bytes only)
        self.fresh = torch.empty(1, model.num_kv_heads, model.head_dim, dtype=torch.bfloat16, device=device)
        self.fresh.view(torch.int16).random_(generator=gen)

    def write_kv(self, batch: ForwardBatch) -> None:
        """The model's K/V writes of ``batch`` into the covered buffers (capturable)."""
        for buf in self.buffers:
            buf[batch.out_cache_loc] = self.fresh


def plan_pool(model: ModelShape, shapes, n_idle: int, free_bytes: int) -> tuple[list, tuple[int, ...], list]:
    """Shapes that fit, covered layers, and (label, why) of the shapes left out: cover the first
    and last layer when the pool's K/V buffers fit ``free_bytes``, else the first layer only;
    drop the largest shapes while even that does not fit."""
    shapes = sorted(shapes, key=lambda s: s.slots)
    skipped = []
    while shapes:
        num_slots = shapes[-1].slots + n_idle + 1
        for layers in ((0, model.num_layers - 1), (0,)):
            need = num_slots * (2 * len(layers) * model.row_bytes + EXTRA_BYTES_PER_SLOT)
            if need <= free_bytes:
                return shapes, layers, skipped
        s = shapes.pop()
        skipped.append((s.label, f"needs {need / 1e9:.1f} GB for one covered layer's K/V and the canary over "
                                  f"{num_slots} slots; {free_bytes / 1e9:.1f} GB available"))
    return [], (0,), skipped


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the copy-bandwidth buffers are cached, not free, until this
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.85) - (1 << 30)
    return CPU_MEMORY_BYTES


class Step:
    """The synthetic page table, token history and batches of one shape over the pool; rows
    1..bs are the requests, row bs+1 an idle cached run of ``n_idle`` slots (sweep target)."""

    def __init__(self, pool: Pool, shape: StepShape, n_idle: int):
        dev, gen, bs = pool.device, pool.gen, shape.bs
        self.pool, self.shape, self.n_idle = pool, shape, n_idle
        held = shape.context + shape.extend
        self.rows, self.max_ctx = bs + 2, max(held, n_idle)
        slots = torch.randperm(pool.num_slots - 1, generator=gen, device=dev)[: bs * held + n_idle] + 1
        self.table = torch.zeros(self.rows, self.max_ctx, dtype=torch.int32, device=dev)
        self.table[1: bs + 1, :held] = slots[: bs * held].view(bs, held).to(torch.int32)
        self.table[bs + 1, :n_idle] = slots[bs * held:].to(torch.int32)
        self.tokens = torch.randint(1, VOCAB, (self.rows, self.max_ctx), generator=gen, device=dev)
        lens = [shape.context] * bs + [n_idle]
        self.fill = self._batch(list(range(1, bs + 2)), [0] * (bs + 1), lens)
        self.fill_tokens = sum(lens)
        self.step = self._batch(list(range(1, bs + 1)), [shape.context] * bs, [shape.extend] * bs)

    def _batch(self, rows: list[int], prefix: list[int], extend: list[int]) -> dict:
        """Keyword arguments of a ForwardBatch (truth included; dropped when the mode has none)."""
        dev = self.table.device
        rpi = torch.tensor(rows, device=dev)
        pl, el = torch.tensor(prefix, device=dev), torch.tensor(extend, device=dev)
        pos = torch.cat([torch.arange(p, p + e, device=dev) for p, e in zip(prefix, extend, strict=True)])
        row_of = rpi.repeat_interleave(el)
        held = pl + el
        return dict(req_pool_indices=rpi, prefix_lens=pl, extend_lens=el, req_to_token=self.table,
                    input_ids=self.tokens[row_of, pos], positions=pos, out_cache_loc=self.table[row_of, pos].long(),
                    truth_ids=torch.cat([self.tokens[r, :h] for r, h in zip(rows, held.tolist(), strict=True)]),
                    truth_offsets=torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), held.cumsum(0)]))

    def batch(self, which: str, truth: bool) -> ForwardBatch:
        kw = dict(getattr(self, which))
        if not truth:
            kw.update(truth_ids=None, truth_offsets=None)
        return ForwardBatch(**kw)

    def idle_run(self) -> SweepRun:
        bs = self.shape.bs
        return SweepRun(self.table[bs + 1, : self.n_idle].long().cpu(), self.tokens[bs + 1, : self.n_idle].tolist(), 0)


def canary_bytes(shape: StepShape, mode: StudyMode, source_read_bytes: int, sweep_bytes: int = 0) -> int:
    """The least bytes the canary's step must move, per step (its own bandwidth floor).

    | part                         | bytes                                                   |
    |------------------------------|---------------------------------------------------------|
    | HEAD and TAIL verify         | 2 * entries * (4 page-table entry + 32 record)          |
    | TAIL fingerprint of prefix   | entries * source_read_bytes                             |
    | HEAD stamp                   | written * (24 token, position, slot + 32 record)        |
    | TAIL fingerprint of writes   | written * (source_read_bytes + 8 recorded)              |
    | truth scatter and checks     | bs * held * (8 + 4) + (entries + written) * 4           |
    | sweep, amortised             | sweep_bytes / interval                                  |

    ``entries = bs * context`` (prefix slots read), ``written = bs * extend``, ``held = context
    + extend``; ``source_read_bytes``: bytes of one slot over all covered sources in this mode."""
    entries, written = shape.bs * shape.context, shape.bs * shape.extend
    n = 2 * entries * (4 + 32) + entries * source_read_bytes + written * (24 + 32) + written * (source_read_bytes + 8)
    if mode.truth:
        n += shape.bs * (shape.context + shape.extend) * (8 + 4) + (entries + written) * 4
    if mode.sweep_interval:
        n += sweep_bytes // mode.sweep_interval
    return n


def _counters(canary: Canary) -> tuple[int, int, int]:
    """(violation rows so far, slots checked, slots stamped) from the device (syncs)."""
    s = canary.state.stats.sum(0).tolist()
    return int(canary.state.ring_counter[0]), s[STAT_CHECKED], s[STAT_STAMPED]


def _sweep_launch(canary: Canary) -> None:
    """The device work of a sweep whose plan is already loaded: one verify of the sweep plan,
    as ``Canary.sweep`` launches it (the host part, building the plan, is not captured)."""
    verify(state=canary.state, plan=canary.sweep_plan, tag=canary.tag(LaunchPoint.SWEEP), sources=canary.sources,
           mode=canary.config.real_kv, meta=canary.meta)


def measure(step: Step, mode: StudyMode, copy_GBps: float, sweep_budget: int, batches: int = 15) -> dict:
    """One (shape, mode) cell: fill, time, check clean, tripwire. Targets are marked on CUDA only."""
    shape, pool, dev = step.shape, step.pool, step.pool.device
    config = CanaryConfig(policy=Policy.LOG, real_kv=mode.real_kv, truth=mode.truth,
                          sweep_interval=mode.sweep_interval, sweep_budget_bytes=sweep_budget,
                          plan_capacity=max(shape.bs * shape.context, step.n_idle, 1), max_bs=shape.bs + 1,
                          max_tokens=max(step.fill_tokens, shape.bs * shape.extend))
    canary = Canary(config, PoolGeometry(pool.num_slots, step.rows, step.max_ctx, str(dev)), sources=pool.sources)
    fill, batch = step.batch("fill", mode.truth), step.batch("step", mode.truth)
    canary.head(fill)
    pool.write_kv(fill)
    canary.tail(fill)
    v0, c0, s0 = _counters(canary)
    canary.head(batch)
    pool.write_kv(batch)
    canary.tail(batch)
    v1, c1, s1 = _counters(canary)
    row = {"shape": shape.label, "mode": mode.name, "mode_label": mode.label, "fill_violations": v0,
           "checked_per_step": c1 - c0, "stamped_per_step": s1 - s0,
           "expected_checked_per_step": 2 * shape.bs * shape.context,
           "expected_stamped_per_step": shape.bs * shape.extend}
    canary.prepare_head(batch)  # the host-fed half of HEAD runs before each replay, outside the graph
    t = timing.time_step([partial(canary.launch_head, batch), partial(pool.write_kv, batch),
                          partial(canary.tail, batch)], dev, "Canary.launch_head + K/V writes + Canary.tail",
                         batches=batches)
    tw = timing.time_step([partial(pool.write_kv, batch)], dev, "the step's K/V writes", batches=batches)
    row.update(canary_us=max(t.us - tw.us, 0.0), timing=t.as_dict(), write_us=tw.us, write_timing=tw.as_dict())
    prepare_us = 0.0
    if mode.truth:  # the truth scatter is device work of every step too, launched outside the graph
        tp = timing.time_step([partial(canary.prepare_head, batch)], dev, "Canary.prepare_head", batches=batches)
        prepare_us = tp.us
        row.update(prepare_us=prepare_us, prepare_timing=tp.as_dict())
    sweep_us = 0.0
    if mode.sweep_interval:
        row["sweep_entries"] = canary.sweep([step.idle_run()])
        ts = timing.time_step([partial(_sweep_launch, canary)], dev, "the sweep's verify", batches=batches)
        sweep_us = ts.us
        row.update(sweep_us=sweep_us, sweep_timing=ts.as_dict(), sweep_interval=mode.sweep_interval)
    timing.synchronize(dev)
    row["violations"] = _counters(canary)[0]
    if row["violations"]:
        n = min(row["violations"], canary.state.ring_capacity, 4)
        row["first_violations"] = [f"{r.tag.point.name} {format_reasons(int(r.reasons))} slot={r.slot}"
                                   for r in decode_rows(canary.state.ring[:n])]
    sweep_share = sweep_us / mode.sweep_interval if mode.sweep_interval else 0.0
    row["per_step_us"] = row["canary_us"] + prepare_us + sweep_share
    floor = shape.floor_us(pool.model, copy_GBps)
    read = sum(4 * s.words_read(mode.real_kv) for s in canary.sources)
    own = canary_bytes(shape, mode, read, row.get("sweep_entries", 0) * canary.entry_bytes())
    row.update(floor_us=floor, pct=100 * row["per_step_us"] / floor, reference_pct=reference_pct(shape),
               canary_bytes=own, canary_bytes_us=timing.floor_us(own, copy_GBps))
    if mode.has_target and dev.type == "cuda":
        row["target"] = "met" if row["pct"] <= TARGET_PCT else f"missed ({row['pct'] / TARGET_PCT:.2f}× the target)"
        if row["pct"] > TARGET_PCT:
            row["why"] = why_missed(row)
    row["tripwire"] = tripwire(canary, step, batch, mode)
    return row


def why_missed(row: dict) -> str:
    """Bytes or latency: whether the canary's own traffic explains its time."""
    us, own = row["per_step_us"], row["canary_bytes_us"]
    if own >= 0.5 * us:
        return (f"bytes: the canary must move {row['canary_bytes'] / 1e6:.1f} MB per step ({own:.1f} µs at the copy "
                f"bandwidth) of its {us:.1f} µs")
    return (f"latency: its bytes need {own:.1f} µs of its {us:.1f} µs; launches and chains of dependent loads "
            "take the rest")


def tripwire(canary: Canary, step: Step, batch: ForwardBatch, mode: StudyMode) -> str:
    """Corrupt one prefix slot (a K word of the first source with real-KV on, else its chain),
    run one eager step, expect a report; restores the slot. 'n/a' when the step reads no prefix."""
    if step.shape.context == 0:
        return "n/a (reads no prefix)"
    slot = int(step.table[1, step.shape.context // 2])
    before = _counters(canary)[0]
    if mode.real_kv is FingerprintMode.NONE:
        words, col, what = record_words(canary.state.records), CHAIN, "chain"
    else:
        words, col, what = canary.sources[0].words.view(canary.sources[0].num_slots, -1), 0, "fingerprint"
    saved = words[slot, col].clone()
    words[slot, col] ^= 1
    canary.head(batch)
    step.pool.write_kv(batch)
    canary.tail(batch)
    words[slot, col] = saved
    caught = _counters(canary)[0] - before
    return f"detected ({what}, {caught} rows)" if caught else f"MISSED ({what} corruption not reported)"


def run_overhead(device: torch.device, *, quick: bool = False, json_path=None, seed: int = 0,
                 modes: tuple[str, ...] | None = None, sweep_budget: int = 1 << 20, model: ModelShape = MODEL_8B,
                 shapes: tuple[StepShape, ...] | None = None) -> dict:
    """Run the study on ``device`` (every listed shape on CUDA, CPU-sized shapes on the CPU, tiny
    ones with ``quick``); prints the table last, writes JSON as it goes; returns the data with
    ``passed`` (no error, every step clean, every tripwire detected)."""
    shapes = shapes or (QUICK_SHAPES if quick else STUDY_SHAPES if device.type == "cuda" else CPU_SHAPES)
    chosen = [m for m in MODES if modes is None or m.name in modes]
    if modes is not None and len(chosen) != len(set(modes)):
        raise ValueError(f"modes {sorted(modes)} must be among {[m.name for m in MODES]}")
    gen = torch.Generator(device=device).manual_seed(seed)
    meta = timing.environment(device) | {"model": vars(model) | {"row_bytes": model.row_bytes,
                                                                 "kv_bytes_per_token": model.kv_bytes_per_token},
                                         "seed": seed, "sweep_budget_bytes": sweep_budget, "quick": quick,
                                         "reference": REFERENCE_NOTE, "target_pct": TARGET_PCT}
    record = RunRecord(json_path, meta)
    record.data.update(rows=[], skipped=[], bandwidth_GBps={})
    print(f"device {meta['device_name']}; torch {meta['torch']}, triton {meta['triton']}; {len(shapes)} shapes x "
          f"{len(chosen)} modes", flush=True)
    with record.section("copy bandwidth"):
        nbytes = (4 << 30) if device.type == "cuda" and not quick else (64 << 20) if quick else (256 << 20)
        record.data["bandwidth_GBps"]["copy"] = timing.copy_bandwidth(device, nbytes)
        print(f"bandwidth copy_ of {nbytes / 2**30:.2f} GiB: {record.data['bandwidth_GBps']['copy']:.0f} GB/s "
              "read+written", flush=True)
    copy = record.data["bandwidth_GBps"].get("copy")
    n_idle = sweep_budget // 80  # the most entries one sweep can take (identity: 2 records + 16 B each)
    fit, layers, skipped = plan_pool(model, shapes, n_idle, free_memory(device))
    record.data["skipped"] = [{"shape": s, "why": w} for s, w in skipped]
    for s, w in skipped:
        print(f"skipped   {s}: {w}", flush=True)
    pool = None
    with record.section("pool"):
        if fit and copy:
            pool = Pool(model, fit[-1].slots + n_idle + 1, layers, device, gen)
            meta.update(num_slots=pool.num_slots, covered_layers=list(layers), kv_sources=len(pool.sources))
            print(f"pool      {pool.num_slots} slots; covered layers {list(layers)} (K and V): {len(pool.sources)} "
                  f"KV sources of {pool.num_slots * model.row_bytes / 1e9:.2f} GB", flush=True)
    for shape in [s for s in shapes if s in fit] if pool else []:  # in the order asked
        step = None
        with record.section(f"{shape.label} setup"):
            step = Step(pool, shape, n_idle)
        for mode in chosen if step else []:
            with record.section(f"{shape.label} {mode.name}"):
                row = measure(step, mode, copy, sweep_budget, batches=3 if quick else 15)
                record.data["rows"].append(row)
                print(f"time      {shape.label:<24} {mode.name:<9} {row['per_step_us']:>10.2f} µs, floor "
                      f"{row['floor_us']:>10.1f} µs: {row['pct']:.4f} % ({row['timing']['mode']}); "
                      f"violations {row['violations']}; tripwire {row['tripwire']}", flush=True)
    rows = record.data["rows"]
    record.data["passed"] = bool(rows) and not record.errors and all(
        r["violations"] == 0 and not r["tripwire"].startswith("MISSED") for r in rows)
    record.save()
    print(f"\nelapsed {record.data['meta']['elapsed_s']} s" + (f"; details in {json_path}" if json_path else ""))
    print_table(record.data)
    return record.data


def print_table(data: dict) -> None:
    rows, meta = data["rows"], data["meta"]
    print(f"{'shape':<24}{'mode':<10}{'canary µs':>11}{'bytes µs':>10}{'sweep µs':>10}{'floor µs':>11}{'canary %':>10}"
          f"{'ref %':>7}  target")
    for r in rows:
        print(f"{r['shape']:<24}{r['mode']:<10}{r['per_step_us']:>11.2f}{r['canary_bytes_us']:>10.2f}"
              f"{fmt(r.get('sweep_us'), '.2f', 10)}{r['floor_us']:>11.1f}{r['pct']:>10.4f}"
              f"{fmt(r['reference_pct'], '.2f', 7)}  {r.get('target', '')}"
              + ("" if r["violations"] == 0 else f"  {r['violations']} VIOLATIONS"))
    bw = data["bandwidth_GBps"].get("copy")
    modes = {r["timing"]["mode"] for r in rows}
    m = meta["model"]
    print(f"copy bandwidth {fmt(bw, '.0f')} GB/s (read+written); model {m['num_layers']} layers, {m['num_kv_heads']} "
          f"KV heads x {m['head_dim']}, {m['weight_bytes'] / 1e9:.0f} GB weights; covered layers "
          f"{meta.get('covered_layers')}; timing: {', '.join(sorted(modes)) or '-'}")
    print(f"canary % = canary µs per step / floor µs; bytes µs = the canary's own bytes at the copy bandwidth; "
          f"sweep µs is one sweep ({meta['sweep_budget_bytes']} B budget), "
          f"amortised over its interval in canary µs; ref % = {meta['reference']}; target ≤ {TARGET_PCT} % for "
          "identity and partial")
    for r in rows:
        if r.get("why"):
            print(f"missed    {r['shape']} {r['mode']}: {r['why']}")
    for e in data["errors"]:
        print(f"error in {e['section']}: {e['error']}")
    captures = {r["timing"]["capture_error"] for r in rows if r["timing"]["capture_error"]}
    captures |= {r["sweep_timing"]["capture_error"] for r in rows if r.get("sweep_timing", {}).get("capture_error")}
    for c in sorted(captures):
        print(f"timed eagerly because {c}")
    print(f"study {'passed' if data['passed'] else 'FAILED'}: {len(rows)} cells, {len(data['errors'])} errors, "
          f"{sum(r['violations'] for r in rows)} violations in timed steps, "
          f"{sum(r['tripwire'].startswith('MISSED') for r in rows)} tripwires missed")


def markdown_table(data: dict) -> str:
    """The study as a Markdown table, for BENCHMARKS.md."""
    out = ["| shape | mode | canary µs / step | its bytes µs | floor µs | canary / floor | published checker "
           "| target |",
           "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in data["rows"]:
        ref = f"{r['reference_pct']:.2f} %" if r["reference_pct"] is not None else ""
        target = r.get("target", "") + (f": {r['why']}" if r.get("why") else "")
        out.append(f"| {r['shape']} | {r['mode_label']} | {r['per_step_us']:.2f} | {r['canary_bytes_us']:.2f} | "
                   f"{r['floor_us']:.1f} | {r['pct']:.4f} % | {ref} | {target} |")
    return "\n".join(out) + "\n"
