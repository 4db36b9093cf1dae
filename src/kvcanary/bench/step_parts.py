"""The pieces of ``bench step``: what a step must cost, its page table and batches, the canary
over its pool, and the ways it is timed (graph capture, interleaved replays, host work, a canary's
first step, the products and attention alone, the bf16 product rate)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from kvcanary.bench import timing
from kvcanary.bench.floors import StepShape
from kvcanary.bench.step_model import Decoder, DecoderShape, StepAttention
from kvcanary.config import CanaryConfig, Policy
from kvcanary.core.record import CHAIN, Half, record_words
from kvcanary.ops.fingerprint import FingerprintMode, KVSource
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.canary import Canary, PoolGeometry

BATCH_MS = 10.0  # a timed batch of replays lasts about this long



@dataclass(frozen=True)
class StepCost:
    bytes: int
    flops: int

    def floor_us(self, copy_GBps: float, tflops: float) -> tuple[float, str]:
        by_bytes, by_flops = timing.floor_us(self.bytes, copy_GBps), self.flops / tflops / 1e6
        return (by_bytes, "bytes") if by_bytes >= by_flops else (by_flops, "FLOPs")


def step_cost(model: DecoderShape, shape: StepShape, weight_bytes: int) -> StepCost:
    """The least a step must move and compute.

    | part        | bytes / FLOPs                                                         |
    |-------------|-----------------------------------------------------------------------|
    | weights     | ``weight_bytes`` (every layer, the final norm, the vocabulary product) |
    | K/V         | (bs * context read + T written) * kv_bytes_per_token                   |
    | products    | 2 * T * num_layers * layer_params + 2 * bs * hidden * vocab            |
    | attention   | 4 * num_layers * H * D * (keys each query sees, summed)                |

    ``T = bs * extend``; query ``c`` of a request sees ``context + c + 1`` keys."""
    tokens = shape.bs * shape.extend
    kv = (shape.bs * shape.context + tokens) * model.kv_bytes_per_token
    flops = (2 * tokens * model.num_layers * model.layer_params + 2 * shape.bs * model.hidden * model.vocab
             + attention_flops(model, shape))
    return StepCost(weight_bytes + kv, flops)


def attention_flops(model: DecoderShape, shape: StepShape) -> int:
    seen = shape.bs * (shape.extend * shape.context + shape.extend * (shape.extend + 1) // 2)
    return 4 * model.num_layers * model.num_heads * model.head_dim * seen


def pool_pages(shapes, page_size: int) -> int:
    """Pages of a pool that holds the largest shape's requests, plus page 0 (slot 0 is reserved)."""
    return 1 + max(s.bs * -(-(s.context + s.extend) // page_size) for s in shapes)


def activation_bytes(model: DecoderShape, shape: StepShape) -> int:
    """A bound on what one step of ``shape`` holds besides the weights and the pool: per written
    token its widest intermediates (the MLP's gate and up halves, the residual, its norm and the
    attention output, the fused q/k/v), bf16, twice over (a graph's pool keeps the capture's)."""
    qkv = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    per_token = 2 * (2 * model.mlp + 4 * model.hidden + qkv)
    return 2 * (shape.bs * shape.extend * per_token + shape.bs * model.vocab * 2)


def fits(model: DecoderShape, shape: StepShape, pool_bytes: int, free_bytes: int) -> str | None:
    """None where a pool of ``pool_bytes`` and the step's activations fit in ``free_bytes``; else
    the line that says why the shape is skipped."""
    need = pool_bytes + activation_bytes(model, shape)
    if need <= free_bytes:
        return None
    return (f"skip      {shape.label:<22} its pool ({pool_bytes / 1e9:.1f} GB of K/V) and activations need "
            f"{need / 1e9:.1f} GB, {free_bytes / 1e9:.1f} GB free beside the weights")


class StepBatch:
    """One shape's page table (random pages of ``page_size`` slots), token history, and the
    fill (writes every prefix) and step batches; request r uses page-table row r + 1."""

    def __init__(self, shape: StepShape, num_pages: int, page_size: int, device, gen, vocab: int):
        bs, held = shape.bs, shape.context + shape.extend
        per_req = -(-held // page_size)
        pages = torch.randperm(num_pages - 1, generator=gen, device=device)[: bs * per_req] + 1
        cols = torch.arange(held, device=device)
        slots = pages.view(bs, per_req)[:, cols // page_size] * page_size + cols % page_size
        self.shape, self.held = shape, held
        self.table = torch.zeros(bs + 1, held, dtype=torch.int32, device=device)
        self.table[1:] = slots.to(torch.int32)
        self.tokens = torch.randint(1, vocab, (bs + 1, held), generator=gen, device=device)
        self.fill = self._batch(shape.bs, 0, shape.context) if shape.context else None
        self.step = self._batch(shape.bs, shape.context, shape.extend)

    def _batch(self, bs: int, prefix: int, extend: int) -> ForwardBatch:
        return uniform_batch(self.table, self.tokens, bs, prefix, extend)


def uniform_batch(table: torch.Tensor, tokens: torch.Tensor, bs: int, prefix: int, extend: int) -> ForwardBatch:
    """Requests 1..bs of ``table`` (page-table rows), each reading ``prefix`` cached positions and
    writing the next ``extend``, whose tokens are ``tokens[row, position]``."""
    dev = table.device
    rows = torch.arange(1, bs + 1, device=dev)
    pos = torch.arange(prefix, prefix + extend, device=dev).repeat(bs)
    row_of = rows.repeat_interleave(extend)
    return ForwardBatch(req_pool_indices=rows, prefix_lens=torch.full((bs,), prefix, device=dev),
                        extend_lens=torch.full((bs,), extend, device=dev), req_to_token=table,
                        input_ids=tokens[row_of, pos], positions=pos, out_cache_loc=table[row_of, pos].long())


def build_canary(model: Decoder, sb: StepBatch, mode: FingerprintMode, num_slots: int, warmup: bool = True,
                 fill: bool = True, overlap: bool = True):
    """A Canary over the pool with K and V of the first and last layer as sources, its prefix
    stamped and fingerprinted through the canary itself (``fill``); returns (canary, seconds to build)."""
    last = model.shape.num_layers - 1
    sources = [KVSource.from_buffer(buf[layer], half=half, layer=layer) for layer in (0, last)
               for half, buf in ((Half.K, model.k_buffers), (Half.V, model.v_buffers))]
    config = CanaryConfig(policy=Policy.LOG, real_kv=mode, max_bs=sb.shape.bs + 1,
                          max_tokens=max(sb.shape.bs * max(sb.shape.context, sb.shape.extend), 1), overlap=overlap)
    t0 = time.perf_counter()
    canary = Canary(config, PoolGeometry(num_slots, sb.table.shape[0], sb.held, str(sb.table.device)),
                    sources=sources, warmup=warmup)
    timing.synchronize(sb.table.device)
    built = time.perf_counter() - t0
    if fill and sb.fill is not None:
        canary.head(sb.fill)
        write_covered(canary, sb.fill)
        canary.tail(sb.fill)
    return canary, built


def write_covered(canary: Canary, batch: ForwardBatch) -> None:
    """Stand-in for the model's K/V writes of ``batch`` into the canary's covered rows (low
    mantissa bits toggled, so values stay finite): TAIL requires every write target written."""
    for src in canary.sources:
        rows = src.words[: src.num_slots * (src.bytes_per_token // 4)].view(src.num_slots, -1).view(torch.int16)
        rows[batch.out_cache_loc] = rows[batch.out_cache_loc] ^ 3


def violations(canary: Canary) -> int:
    return int(canary.state.ring_counter[0])


def capture(fns, pool) -> torch.cuda.CUDAGraph:
    """A graph launching ``fns`` in order (already run eagerly, so every kernel is compiled)."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        timing.run_all(fns)
    return graph


def interleaved(graphs: dict, repeats: int) -> dict[str, list[float]]:
    """µs per step of each graph, one batch of replays per graph per repeat, rotating the order."""
    names = list(graphs)
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    graphs[names[0]].replay()
    torch.cuda.synchronize()
    one_ms = (time.perf_counter() - t0) * 1e3
    reps = max(1, min(10, round(BATCH_MS / max(one_ms, 1e-3))))
    out = {n: [] for n in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        events = []
        for n in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                graphs[n].replay()
            end.record()
            events.append((n, start, end))
        torch.cuda.synchronize()
        for n, start, end in events:
            out[n].append(start.elapsed_time(end) * 1e3 / reps)
    return out


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def tripwire(canary: Canary, graph, sb: StepBatch, mode: FingerprintMode) -> str:
    """Corrupt one prefix slot (its chain, or with real-KV a K word of layer 0), replay once,
    expect a report; restores the slot."""
    if sb.shape.context == 0:
        return "n/a (reads no prefix)"
    slot = int(sb.table[1, sb.shape.context // 2])
    if mode is FingerprintMode.NONE:
        words, col, what = record_words(canary.state.records), CHAIN, "chain"
    else:
        src = canary.sources[0]
        words, col, what = src.words.view(src.num_slots, -1), 0, "K word"
    before = violations(canary)
    saved = words[slot, col].clone()
    words[slot, col] ^= 1
    graph.replay()
    torch.cuda.synchronize()
    words[slot, col] = saved
    caught = violations(canary) - before
    return f"detected ({what}, {caught} rows)" if caught else f"MISSED ({what} corruption not reported)"


def host_us(canary: Canary, graph, batch: ForwardBatch, steps: int = 30) -> dict:
    """Wall µs per step of the canary's host calls outside the graph (``prepare_head`` +
    ``end_step``; the replay's own launch not counted), the device synchronised before each
    step, so ``end_step`` finds the previous step done, two ways: ``work``, ``end_step`` after
    the replay completed (the device idle), and ``in_flight``, ``end_step`` right behind the
    replay's launch, the step running (as an engine runs it, less the wait for a step that is
    still running)."""
    out = {"work": [], "in_flight": []}
    for i in range(2 * steps):
        kind = "work" if i % 2 == 0 else "in_flight"
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        canary.prepare_head(batch)
        t1 = time.perf_counter()
        graph.replay()
        if kind == "work":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        canary.end_step(i)
        out[kind].append((t1 - t0 + time.perf_counter() - t2) * 1e6)
    torch.cuda.synchronize()
    skip = min(3, steps - 1)
    return {k: spread(v[skip:]) for k, v in out.items()}


def first_vs_steady(canary: Canary, batch: ForwardBatch, steps: int = 10) -> dict:
    """Wall µs of a canary's first eager HEAD + TAIL (synchronised) and the median of the next ones,
    with the batch's K/V writes of the covered rows between them (``write_covered``, run twice
    before timing so that its own first launches are not the canary's)."""
    write_covered(canary, batch)  # the stand-in's own first launches (twice: the rows are as before)
    write_covered(canary, batch)
    out = []
    for _ in range(steps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        canary.head(batch)
        write_covered(canary, batch)
        canary.tail(batch)
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e6)
    return {"first_us": out[0], "steady_us": statistics.median(out[1:]), "violations": violations(canary)}


def phase_floor_us(model: DecoderShape, shape: StepShape, weight_bytes: int, copy_GBps: float,
                   tflops: float) -> float:
    """A tighter floor for steps whose phases are bound differently: the products (weights,
    product FLOPs) and the attention (K/V bytes, attention FLOPs) each at their own bound, summed."""
    full, attn_flops = step_cost(model, shape, weight_bytes), attention_flops(model, shape)
    kv = full.bytes - weight_bytes
    products = StepCost(weight_bytes, full.flops - attn_flops).floor_us(copy_GBps, tflops)[0]
    return products + StepCost(kv, attn_flops).floor_us(copy_GBps, tflops)[0]


def parts_us(model: Decoder, sb: StepBatch, attn: StepAttention, repeats: int = 3) -> dict:
    """Graph-replay µs of the step's products alone (every layer's four and the vocabulary one)
    and of its 32 paged attentions alone, on the step's shapes (where the step's time goes)."""
    s, dev, b = model.shape, model.device, sb.step
    n, bs = b.input_ids.shape[0], b.batch_size
    h = torch.randn(n, s.hidden, dtype=model.dtype, device=dev)
    a = torch.randn(n, s.num_heads * s.head_dim, dtype=model.dtype, device=dev)
    m = torch.randn(n, s.mlp, dtype=model.dtype, device=dev)
    q = torch.randn(n, s.num_heads, s.head_dim, dtype=model.dtype, device=dev)
    last = torch.randn(bs, s.hidden, dtype=model.dtype, device=dev)

    def products():
        for layer in model.layers:
            torch.nn.functional.linear(h, layer["qkv"])
            torch.nn.functional.linear(a, layer["o"])
            torch.nn.functional.linear(h, layer["gate_up"])
            torch.nn.functional.linear(m, layer["down"])
        torch.matmul(last, model.lm_head.t())

    def attention():
        for i in range(s.num_layers):
            attn(q, model.k_buffers[i], model.v_buffers[i], b)

    out = {}
    for name, fn in (("products", products), ("attention", attention)):
        fn()
        torch.cuda.synchronize()
        graph = capture([fn], None)
        out[name] = spread(interleaved({name: graph}, repeats)[name])
        del graph
    return out


def matmul_tflops(device) -> float:
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    c = torch.empty_like(a)
    us = timing.median_us(lambda: torch.matmul(a, b, out=c), device, 5, 10)
    return 2 * n**3 / us / 1e6
