"""The real-step benchmark's arithmetic, page table and layer kernels on the CPU (the timed run
itself needs CUDA: ``kv-canary bench step`` on a CPU says so and exits 2)."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from kvcanary.bench.floors import StepShape
from kvcanary.bench.step import MODEL
from kvcanary.bench.step_model import Decoder, DecoderShape, StepAttention, rms_norm, rope_store, silu_mul
from kvcanary.bench.step_parts import (
    StepBatch,
    StepCost,
    activation_bytes,
    build_canary,
    fits,
    phase_floor_us,
    pool_pages,
    step_cost,
)
from kvcanary.cli import app
from kvcanary.ops.fingerprint import FingerprintMode

TINY = DecoderShape(num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp=96, vocab=50)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_8b_geometry():
    # 4096 * 6144 (qkv) + 4096 * 4096 (o) + 3 * 4096 * 14336 (gate, up, down)
    assert MODEL.layer_params == 218_103_808
    assert MODEL.kv_bytes_per_token == 131_072


def test_step_cost_by_hand():
    # decode bs 2 @ 10: (20 read + 2 written) K/V rows; FLOPs: products + vocab + 11 keys per query
    c = step_cost(TINY, StepShape.decode(2, 10), weight_bytes=1000)
    kv_token = 2 * 2 * 2 * 16 * 2
    assert c.bytes == 1000 + 22 * kv_token
    assert c.flops == 2 * 2 * 2 * TINY.layer_params + 2 * 2 * 64 * 50 + 4 * 2 * 4 * 16 * 22
    # prefill 3 tokens, bs 1: queries see 1 + 2 + 3 keys
    p = step_cost(TINY, StepShape.prefill(3, 1), weight_bytes=0)
    assert p.bytes == 3 * kv_token and p.flops == 2 * 3 * 2 * TINY.layer_params + 2 * 64 * 50 + 4 * 2 * 4 * 16 * 6
    # phases: products at 1 TFLOP/s (their FLOPs), attention at 1 GB/s (its K/V bytes) -> the sum
    shape = StepShape.decode(2, 10)
    products = (2 * 2 * 2 * TINY.layer_params + 2 * 2 * 64 * 50) / 1e6
    assert phase_floor_us(TINY, shape, 0, 1.0, 1.0) == pytest.approx(products + 22 * kv_token / 1e3)
    assert StepCost(4_000_000, 10**6).floor_us(copy_GBps=1.0, tflops=1.0) == (4000.0, "bytes")
    assert StepCost(4000, 10**12).floor_us(copy_GBps=1000.0, tflops=0.5) == (2.0e6, "FLOPs")


def test_page_table_is_distinct_pages():
    shape = StepShape.decode(3, 37)
    pages = pool_pages([shape, StepShape.prefill(20, 1)], 8)
    assert pages == 1 + 3 * 5
    gen = torch.Generator().manual_seed(0)
    sb = StepBatch(shape, pages, 8, "cpu", gen, vocab=50)
    slots = sb.table[1:].flatten()
    assert slots.unique().numel() == slots.numel() and int(slots.min()) >= 8  # page 0 (slot 0) unused
    assert torch.equal(sb.table[1:, 1:8] - sb.table[1:, :7], torch.ones(3, 7, dtype=torch.int32))  # within a page
    b = sb.step
    assert b.positions.tolist() == [37] * 3 and torch.equal(b.out_cache_loc, sb.table[1:, 37].long())
    assert sb.fill.extend_lens.tolist() == [37] * 3 and sb.fill.input_ids.numel() == 111


def test_each_shape_sizes_its_own_pool_and_one_that_does_not_fit_is_named():
    """``bench step`` sizes the pool per shape: an 80 GB card with 16 GB of weights holds the
    pool of a 64 x 4096 decode but not the 68.8 GB one of a 16 x 32768 decode, which is skipped
    with a line that names it; the model's pool follows the size asked."""
    model, gb = DecoderShape(), 10**9
    free = 80 * gb - 16 * gb
    small, large = StepShape.decode(64, 4096), StepShape.decode(16, 32768)
    sizes = {s: pool_pages([s], 16) * 16 * model.kv_bytes_per_token for s in (small, large)}
    assert round(sizes[large] / gb, 1) == 68.8 and sizes[small] < 35 * gb
    assert fits(model, small, sizes[small], free) is None
    line = fits(model, large, sizes[large], free)
    assert line.startswith(f"skip      {large.label} ") and "68.8 GB of K/V" in line and "64.0 GB free" in line
    assert 0 < activation_bytes(model, small) < activation_bytes(model, StepShape.prefill(16384, 4))
    tiny = Decoder(TINY, 24, "cpu", torch.Generator().manual_seed(0), dtype=torch.float32)
    tiny.allocate_pool(40)
    assert tiny.num_slots == 40 and all(b.shape == (40, 2, 16) for b in tiny.k_buffers + tiny.v_buffers)


@pytest.mark.parametrize("seed", [0, 1])
def test_layer_kernels_match_torch(seed):
    gen = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    x = torch.randn(5, 64, generator=gen).to(dt).to(DEV)
    delta = torch.randn(5, 64, generator=gen).to(dt).to(DEV)
    w = torch.randn(64, generator=gen).to(dt).to(DEV)
    x1, x2 = x.clone(), x.clone()
    torch.testing.assert_close(rms_norm(x1, delta, w, 1e-5, True), rms_norm(x2, delta, w, 1e-5, False),
                               atol=2e-2, rtol=2e-2)
    assert torch.equal(x1, x2)  # the residual add, in place
    qkv = torch.randn(5, (4 + 2 * 2) * 16, generator=gen).to(dt).to(DEV)
    pos = torch.tensor([0, 3, 7, 100, 4095], device=DEV)
    loc = torch.tensor([9, 2, 5, 11, 1], device=DEV)
    bufs = [torch.randn(12, 2, 16, generator=gen).to(dt).to(DEV) for _ in range(2)]
    got_k, got_v = bufs[0].clone(), bufs[1].clone()
    q = rope_store(qkv, pos, loc, got_k, got_v, TINY, True)
    want_q = rope_store(qkv, pos, loc, bufs[0], bufs[1], TINY, False)
    torch.testing.assert_close(q, want_q, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_k, bufs[0], atol=2e-2, rtol=2e-2)
    assert torch.equal(got_v, bufs[1])
    gu = torch.randn(5, 2 * 96, generator=gen).to(dt).to(DEV)
    torch.testing.assert_close(silu_mul(gu, True), silu_mul(gu, False), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("shape", [StepShape.decode(2, 9), StepShape.prefill(6, 2)], ids=lambda s: s.label)
def test_tiny_step_with_canary_is_clean_and_writes_its_kv(shape):
    """The whole step eagerly on the CPU: the canary around it reports nothing, the forward
    writes the step's K/V into every layer, and the canary sees a corrupted prefix."""
    gen = torch.Generator().manual_seed(3)
    pages = pool_pages([shape], 4)
    model = Decoder(TINY, pages * 4, "cpu", gen, dtype=torch.float32)
    sb = StepBatch(shape, pages, 4, "cpu", gen, TINY.vocab)
    attn = StepAttention(TINY, sb.step, shape.kind == "decode", sb.held, shape.extend)
    canary, _ = build_canary(model, sb, FingerprintMode.PARTIAL, pages * 4)
    before = model.k_buffers[1][sb.step.out_cache_loc].clone()
    logits = torch.empty(shape.bs, TINY.vocab)
    with canary.forward(sb.step):
        model.forward(sb.step, attn, logits)
    assert int(canary.state.ring_counter[0]) == 0
    assert not torch.equal(model.k_buffers[1][sb.step.out_cache_loc], before) and logits.isfinite().all()
    if shape.context:
        model.k_buffers[0][int(sb.table[1, 2])] += 1.0
        with canary.forward(sb.step):
            model.forward(sb.step, attn, logits)
        assert int(canary.state.ring_counter[0]) > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_bench_step_on_cpu_exits_2():
    result = CliRunner().invoke(app, ["bench", "step", "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        "bench step needs a CUDA GPU (an 8B-shaped model in bf16); this run has cpu: nothing timed"]
