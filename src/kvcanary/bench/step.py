"""``kv-canary bench step``: the canary's cost on a real 8B-shaped decoder step, on CUDA.

Every step shape runs the whole model (``bench/step_model.py``: 32 layers of products over random
bf16 weights, RoPE, K/V written into the pool at ``out_cache_loc``, paged attention through the
page table, the vocabulary product) in one CUDA graph, three ways, replayed interleaved in one run:

| mode     | graph                                                        |
|----------|--------------------------------------------------------------|
| off      | the forward                                                  |
| identity | ``Canary.launch_head``, the forward, ``Canary.tail`` (real-KV none) |
| partial  | the same, real-KV partial over K and V of layers 0 and 31    |

The canary runs HEAD's checks and TAIL on its side stream (``CanaryConfig.overlap``), TAIL started
by ``Canary.start_tail`` once layer 31 (the last covered layer) has written and read its K/V.
Compared beside them in the same run: partial with TAIL started after the forward (an engine with
no hook inside its model), identity and partial with everything on one stream (overlap off), and
``off_forked``: the canary-off forward with an empty side branch (what the graph's shape alone does).

Each shape runs over a pool sized to its own requests; a shape whose pool and activations do
not fit the card beside the weights is skipped with one line (``skipped`` in the JSON).
``prepare_head`` (host-fed) runs outside the graphs. Each repeat times every mode once, in a
rotating order, over batches of replays (CUDA events); figures are medians over repeats with
their min-max spread, and ``on / off`` is the median of the per-repeat ratios. Each step is put
beside its floor, the larger of (weights + K/V read + K/V written) / measured copy bandwidth and
FLOPs / measured bf16 product rate, and must stay within ``FLOOR_TARGET`` of it. The timed
on-steps must report zero violations; a tripwire (one corrupted prefix record or K word, one
replay) must report some. The warm-up section times building a canary (its kernels compiled
by ``Canary.warmup``) and a canary's first step against its steady step, with and without it.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch

from kvcanary.bench import timing
from kvcanary.bench.floors import StepShape
from kvcanary.bench.paged_attention import tuned_tiles
from kvcanary.bench.results import RunRecord, fmt
from kvcanary.bench.step_model import Decoder, DecoderShape, StepAttention
from kvcanary.bench.step_parts import (
    StepBatch,
    build_canary,
    capture,
    first_vs_steady,
    fits,
    host_us,
    interleaved,
    matmul_tflops,
    parts_us,
    phase_floor_us,
    pool_pages,
    spread,
    step_cost,
    tripwire,
    violations,
)
from kvcanary.ops.fingerprint import FingerprintMode

FLOOR_TARGET = 1.5
MODEL = DecoderShape()
SHAPES = (StepShape.decode(1, 512), StepShape.decode(1, 4096), StepShape.decode(64, 512), StepShape.decode(64, 4096),
          StepShape.decode(256, 512), StepShape.decode(16, 32768), StepShape.prefill(16384, 1),
          StepShape.prefill(16384, 4))
QUICK_SHAPES = (StepShape.decode(1, 512), StepShape.decode(64, 4096), StepShape.prefill(16384, 1))


@dataclass(frozen=True)
class Mode:
    """A canary-on graph: its real-KV mode, whether the canary runs HEAD's checks and TAIL on a
    side stream (``CanaryConfig.overlap``), and whether TAIL starts after the last covered layer's
    attention (``Canary.start_tail``, inside the forward) rather than after the forward."""

    real_kv: FingerprintMode
    overlap: bool = True
    early_tail: bool = True


MODES = {"identity": Mode(FingerprintMode.NONE), "partial": Mode(FingerprintMode.PARTIAL)}
# the same canary placed the ways an engine without an in-model hook (or with overlap off) places it
COMPARED = {"partial_tail_at_end": Mode(FingerprintMode.PARTIAL, early_tail=False),
            "partial_one_stream": Mode(FingerprintMode.PARTIAL, overlap=False),
            "identity_one_stream": Mode(FingerprintMode.NONE, overlap=False)}


def warmup_study(model: Decoder, sb: StepBatch, num_slots: int) -> dict:
    """Build time with warm-up (kernels compiled on construction), first vs steady step (the
    prefill of the shape's prefix, repeated: same slots, same records), and a canary built
    without warm-up in a mode not compiled before (real-KV all): what its first step pays."""
    out = {}
    for label, mode, warm in (("partial, warm-up on construction", FingerprintMode.PARTIAL, True),
                              ("identity, warm-up on construction", FingerprintMode.NONE, True),
                              ("partial, again (kernels cached)", FingerprintMode.PARTIAL, True),
                              ("all, no warm-up", FingerprintMode.ALL, False)):
        canary, built = build_canary(model, sb, mode, num_slots, warmup=warm, fill=False)
        row = {"build_s": built, "warmup_s": canary.warmup_seconds} | first_vs_steady(canary, sb.fill or sb.step)
        out[label] = row
        print(f"warm-up   {label:<36} build {built:8.3f} s (warm-up {canary.warmup_seconds:.3f} s); first step "
              f"{row['first_us']:>12.0f} µs, steady {row['steady_us']:>8.0f} µs", flush=True)
        del canary
    return out


def measure_shape(model: Decoder, shape: StepShape, num_pages: int, page_size: int, gen, repeats: int,
                  rates: dict) -> dict:
    dev = model.device
    num_slots = num_pages * page_size
    sb = StepBatch(shape, num_pages, page_size, dev, gen, model.shape.vocab)
    attn = StepAttention(model.shape, sb.step, shape.kind == "decode", sb.held, shape.extend)
    logits = torch.empty(shape.bs, model.shape.vocab, dtype=model.dtype, device=dev)
    modes = MODES | COMPARED
    canaries = {name: build_canary(model, sb, m.real_kv, num_slots, overlap=m.overlap)[0] for name, m in modes.items()}
    fns = {"off": [lambda: model.forward(sb.step, attn, logits)]}
    last = model.shape.num_layers - 1  # the last covered layer (build_canary covers the first and last)
    for name, c in canaries.items():
        c.prepare_head(sb.step)
        hook = {last: lambda c=c: c.start_tail(sb.step)} if modes[name].early_tail else None
        fns[name] = [lambda c=c: c.launch_head(sb.step), lambda hook=hook: model.forward(sb.step, attn, logits, hook),
                     lambda c=c: c.tail(sb.step)]
    fns["off_forked"] = forked_control(fns["off"][0], dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns.values():
            timing.run_all(f)
    torch.cuda.current_stream().wait_stream(side)
    pool = torch.cuda.graph_pool_handle()
    graphs = {name: capture(f, pool) for name, f in fns.items()}
    before = {n: violations(c) for n, c in canaries.items()}
    times = interleaved(graphs, repeats)
    row = {"shape": shape.label, "kind": shape.kind, "bs": shape.bs, "context": shape.context,
           "extend": shape.extend, "page_size": page_size, "repeats": repeats}
    for name, ts in times.items():
        row[name] = spread(ts)
    for name in ("off_forked", *modes):
        ratios = [on / off for on, off in zip(times[name], times["off"], strict=True)]
        row[f"{name}_ratio"] = spread(ratios)
        if name == "off_forked":
            continue
        row[f"{name}_violations"] = violations(canaries[name]) - before[name]
        row[f"{name}_tripwire"] = tripwire(canaries[name], graphs[name], sb, modes[name].real_kv)
    row["host_partial"] = host_us(canaries["partial"], graphs["partial"], sb.step,
                                  steps=30 if shape.kind == "decode" else 6)
    del graphs, fns
    row["parts"] = parts_us(model, sb, attn)
    row["attention_tiles"] = tuned_tiles()["decode" if shape.kind == "decode" else "prefill"]
    cost = step_cost(model.shape, shape, model.weight_bytes)
    floor, bound = cost.floor_us(rates["copy_GBps"], rates["bf16_TFLOPs"])
    phases = phase_floor_us(model.shape, shape, model.weight_bytes, rates["copy_GBps"], rates["bf16_TFLOPs"])
    row.update(bytes=cost.bytes, flops=cost.flops, floor_us=floor, bound=bound,
               step_over_floor=row["off"]["median"] / floor, phase_floor_us=phases,
               step_over_phase_floor=row["off"]["median"] / phases)
    row["floor_target"] = ("met" if row["step_over_floor"] <= FLOOR_TARGET
                           else f"missed ({row['step_over_floor']:.2f}× its floor > {FLOOR_TARGET}×)")
    del canaries
    return row


def forked_control(forward, device) -> list:
    """The canary-off forward with an empty branch beside it (a side stream forked before the
    forward, one tiny kernel on it, joined after): what the graph's shape alone does to the step."""
    side, cur, flag = torch.cuda.Stream(device), torch.cuda.current_stream, torch.zeros(1, device=device)

    def fork():
        side.wait_stream(cur())
        with torch.cuda.stream(side):
            flag.add_(1)

    return [fork, forward, lambda: cur().wait_stream(side)]


def run_step(device: torch.device, *, quick: bool = False, json_path=None, seed: int = 0,
             model_shape: DecoderShape = MODEL, shapes: tuple[StepShape, ...] | None = None, page_size: int = 16,
             repeats: int | None = None) -> dict:
    """Run the real-step benchmark on CUDA (see module doc); prints the table last, writes JSON
    as it goes; returns the data with ``passed`` (no error, clean timed steps, tripwires caught)."""
    if device.type != "cuda":
        raise ValueError(f"bench step needs a CUDA device, got {device}")
    shapes = shapes or (QUICK_SHAPES if quick else SHAPES)
    gen = torch.Generator(device=device).manual_seed(seed)
    meta = timing.environment(device) | {"model": vars(model_shape), "seed": seed, "page_size": page_size,
                                         "floor_target": FLOOR_TARGET, "quick": quick}
    record = RunRecord(json_path, meta)
    record.data.update(rows=[], rates={}, warmup={})
    print(f"device {meta['device_name']}; torch {meta['torch']}, triton {meta['triton']}; {len(shapes)} shapes x "
          f"off / {' / '.join(MODES)}", flush=True)
    rates = record.data["rates"]
    with record.section("rates"):
        rates["copy_GBps"] = timing.copy_bandwidth(device, 4 << 30)
        rates["bf16_TFLOPs"] = matmul_tflops(device)
        print(f"rates     copy {rates['copy_GBps']:.0f} GB/s (read+written), bf16 8192^3 product "
              f"{rates['bf16_TFLOPs']:.0f} TFLOP/s", flush=True)
        torch.cuda.empty_cache()
    num_pages = pool_pages(shapes[:1], page_size)  # each shape's own pool, sized when it runs (``_pool_for``)
    model = None
    with record.section("model"):
        t0 = time.perf_counter()
        model = Decoder(model_shape, num_pages * page_size, device, gen)
        torch.cuda.synchronize()
        meta.update(num_slots=num_pages * page_size, weight_bytes=model.weight_bytes,
                    pool_bytes=num_pages * page_size * model_shape.kv_bytes_per_token)
        print(f"model     {model.weight_bytes / 1e9:.2f} GB of weights, pool of {num_pages * page_size} slots "
              f"({meta['pool_bytes'] / 1e9:.1f} GB of K/V), built in {time.perf_counter() - t0:.1f} s", flush=True)
    if model is not None and "copy_GBps" in rates:
        with record.section("warm-up"):
            sb = StepBatch(shapes[0], num_pages, page_size, device, gen, model_shape.vocab)
            record.data["warmup"] = warmup_study(model, sb, num_pages * page_size)
            del sb
        for shape in shapes:
            pages = _pool_for(model, shape, page_size, record)
            if pages is None:
                continue
            with record.section(shape.label):
                reps = repeats or (5 if shape.kind == "prefill" else 9)
                row = measure_shape(model, shape, pages, page_size, gen, reps, rates)
                record.data["rows"].append(row)
                print(f"time      {shape.label:<22} off {row['off']['median']:>10.1f} µs "
                      f"({row['step_over_floor']:.2f}× "
                      f"floor {row['floor_us']:.1f}, {row['bound']}); identity {row['identity_ratio']['median']:.4f}, "
                      f"partial {row['partial_ratio']['median']:.4f} of off; violations "
                      f"{row['identity_violations']}/{row['partial_violations']}; tripwires "
                      f"{row['identity_tripwire']} / {row['partial_tripwire']}", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
    rows = record.data["rows"]
    record.data["passed"] = bool(rows) and not record.errors and all(
        r[f"{m}_violations"] == 0 and not r[f"{m}_tripwire"].startswith("MISSED") for r in rows
        for m in MODES | COMPARED)
    record.save()
    print(f"\nelapsed {record.data['meta']['elapsed_s']} s" + (f"; details in {json_path}" if json_path else ""))
    print_table(record.data)
    return record.data


def _pool_for(model: Decoder, shape: StepShape, page_size: int, record: RunRecord) -> int | None:
    """The pages of ``shape``'s own pool, ``model``'s pool sized to them where it fits the card
    beside the weights; None, with one line printed and recorded, for a shape that does not fit."""
    pages = pool_pages([shape], page_size)
    if pages * page_size == model.num_slots:
        return pages
    model.allocate_pool(0)  # the last shape's pool released before the next one is sized
    gc.collect()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(model.device)
    line = fits(model.shape, shape, pages * page_size * model.shape.kv_bytes_per_token, free)
    if line is not None:
        print(line, flush=True)
        record.data.setdefault("skipped", []).append({"shape": shape.label, "reason": line.split(None, 2)[2]})
        return None
    model.allocate_pool(pages * page_size)
    return pages


def _sp(s: dict) -> str:
    return f"{s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}]"


def _ratio(s: dict) -> str:
    return f"{s['median']:.4f} [{s['min']:.4f}-{s['max']:.4f}]"


def print_table(data: dict) -> None:
    print(f"{'shape':<22}{'off µs [min-max]':>28}{'identity µs':>28}{'partial µs':>28}{'identity/off':>28}"
          f"{'partial/off':>28}{'floor µs':>11}{'step/floor':>11}  target")
    for r in data["rows"]:
        print(f"{r['shape']:<22}{_sp(r['off']):>28}{_sp(r['identity']):>28}{_sp(r['partial']):>28}"
              f"{_ratio(r['identity_ratio']):>28}{_ratio(r['partial_ratio']):>28}{r['floor_us']:>11.1f}"
              f"{r['step_over_floor']:>11.2f}  {r['floor_target']} ({r['bound']})")
    for r in data["rows"]:
        print(f"compared  {r['shape']:<22} " + "; ".join(
            f"{name} {_ratio(r[f'{name}_ratio'])}" for name in ("off_forked", *COMPARED) if f"{name}_ratio" in r))
    for r in data["rows"]:
        w, f, p = r["host_partial"]["work"], r["host_partial"]["in_flight"], r["parts"]
        print(f"parts     {r['shape']:<22} products {_sp(p['products'])} µs, attention {_sp(p['attention'])} µs; "
              f"phase floor {r['phase_floor_us']:.1f} µs (step {r['step_over_phase_floor']:.2f}× it); host "
              f"prepare_head + end_step {_sp(w)} µs with the device idle, {_sp(f)} µs with the step in flight; "
              f"attention tiles "
              f"{r['attention_tiles']}")
    rates = data["rates"]
    print(f"rates: copy {fmt(rates.get('copy_GBps'), '.0f')} GB/s, bf16 {fmt(rates.get('bf16_TFLOPs'), '.0f')} "
          f"TFLOP/s; page size {data['meta']['page_size']}; on/off = median of per-repeat ratios [min-max]")
    for e in data["errors"]:
        print(f"error in {e['section']}: {e['error']}")
    print(f"bench step {'passed' if data.get('passed') else 'FAILED'}: {len(data['rows'])} shapes")


def markdown_table(data: dict) -> str:
    out = ["| shape | off µs [min–max] | identity µs | partial µs | identity / off | partial / off | floor µs "
           "(bound) | step / floor | step / phase floor | host µs (partial, idle) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        miss = "" if r["floor_target"] == "met" else " (missed 1.5×)"
        out.append(f"| {r['shape']} | {_sp(r['off'])} | {_sp(r['identity'])} | {_sp(r['partial'])} | "
                   f"{_ratio(r['identity_ratio'])} | {_ratio(r['partial_ratio'])} | {r['floor_us']:.1f} ({r['bound']}) "
                   f"| {r['step_over_floor']:.2f}{miss} | {r['step_over_phase_floor']:.2f} | "
                   f"{r['host_partial']['work']['median']:.1f} |")
    compared = ("off_forked", *COMPARED)
    out += ["", "| shape | " + " | ".join(f"{name} / off" for name in compared) + " |",
            "|---|" + "---:|" * len(compared)]
    for r in data["rows"]:
        out.append(f"| {r['shape']} | " + " | ".join(_ratio(r[f"{name}_ratio"]) for name in compared) + " |")
    return "\n".join(out) + "\n"



def run_step_command(device: torch.device, *, quick: bool, json_path, markdown, seed: int) -> int:
    """``kv-canary bench step``; returns the exit status: 2 without CUDA, 1 when the run did not pass."""
    if device.type != "cuda":
        print(f"bench step needs a CUDA GPU (an 8B-shaped model in bf16); this run has {device.type}: nothing timed")
        return 2
    data = run_step(device, quick=quick, json_path=json_path, seed=seed)
    if markdown is not None:
        markdown.write_text(markdown_table(data))
    return 0 if data["passed"] else 1
