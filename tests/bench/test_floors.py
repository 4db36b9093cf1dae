"""Bandwidth floors and the study's arithmetic against hand-computed numbers."""

from __future__ import annotations

import pytest
import torch

from kvcanary.bench import timing
from kvcanary.bench.floors import MODEL_8B, STUDY_SHAPES, ModelShape, StepShape, reference_pct
from kvcanary.bench.overhead import MODES, canary_bytes, plan_pool, why_missed

# 8B-shaped model: 32 layers x (K, V) x 8 heads x 128 dims x 2 bytes = 131072 bytes per token
PER_TOKEN = 32 * 2 * 8 * 128 * 2


def test_model_geometry():
    assert MODEL_8B.row_bytes == 2048
    assert MODEL_8B.kv_bytes_per_token == PER_TOKEN == 131072
    assert MODEL_8B.weight_bytes == 16_000_000_000


@pytest.mark.parametrize("shape, read, written, floor_us", [
    # decode bs 64 @ 4096: 64*4096 tokens read, 64 written; (16e9 + 34359738368 + 8388608) B / 4000 GB/s
    (StepShape.decode(64, 4096), 34_359_738_368, 8_388_608, 12_592.031744),
    # decode bs 1 @ 512: (16e9 + 67108864 + 131072) B / 4000 GB/s
    (StepShape.decode(1, 512), 67_108_864, 131_072, 4_016.809984),
    # prefill 16384 x bs 32: nothing read, 524288 tokens written; (16e9 + 68719476736) B / 4000 GB/s
    (StepShape.prefill(16384, 32), 0, 68_719_476_736, 21_179.869184),
])
def test_step_floor_by_hand(shape, read, written, floor_us):
    b = shape.bytes(MODEL_8B)
    assert (b["weights"], b["kv_read"], b["kv_written"]) == (16_000_000_000, read, written)
    assert b["total"] == 16_000_000_000 + read + written
    assert shape.floor_us(MODEL_8B, 4000.0) == pytest.approx(floor_us, rel=1e-12)


def test_floor_us_and_its_errors():
    assert timing.floor_us(1e9, 1000.0) == pytest.approx(1000.0)  # 1 GB at 1000 GB/s = 1 ms
    assert timing.floor_us(0, 5.0) == 0
    with pytest.raises(ValueError, match="copy_GBps must be > 0, got 0"):
        timing.floor_us(10, 0)
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -1"):
        timing.floor_us(-1, 10)


def test_step_shape_validation_names_the_field():
    with pytest.raises(ValueError, match="kind must be 'decode' or 'prefill', got 'verify'"):
        StepShape("verify", 1, 0, 1)
    with pytest.raises(ValueError, match="bs=0"):
        StepShape.decode(0, 512)


def test_study_shapes_and_reference_columns():
    labels = [s.label for s in STUDY_SHAPES]
    assert labels[:3] == ["decode bs 1 @ 512", "decode bs 1 @ 4096", "decode bs 1 @ 32768"]
    assert labels[-2:] == ["prefill 16384 × bs 1", "prefill 16384 × bs 32"] and len(labels) == 11
    assert reference_pct(StepShape.decode(64, 4096)) == 0.52
    assert reference_pct(StepShape.decode(1, 32768)) == 2.10
    assert reference_pct(StepShape.prefill(16384, 1)) == 2.17
    assert reference_pct(StepShape.decode(256, 512)) is None and reference_pct(StepShape.prefill(300, 1)) is None


def test_plan_pool_covers_fewer_layers_then_drops_shapes():
    model = ModelShape(num_layers=4, num_kv_heads=1, head_dim=8, weight_bytes=1)  # 16-byte rows
    small, big = StepShape.decode(1, 99), StepShape.decode(10, 99)  # 100 and 1000 slots
    per_slot_two_layers = 2 * 2 * 16 + 200  # K and V of layers 0 and 3, plus the canary's extras
    need_big = (1000 + 10 + 1) * per_slot_two_layers
    assert plan_pool(model, [big, small], 10, need_big) == ([small, big], (0, 3), [])
    assert plan_pool(model, [big, small], 10, need_big - 1)[1] == (0,)  # one layer's K and V fit
    shapes, layers, skipped = plan_pool(model, [big, small], 10, (100 + 10 + 1) * (2 * 16 + 200))
    assert shapes == [small] and layers == (0,) and [s for s, _ in skipped] == ["decode bs 10 @ 99"]


def test_culprit_names_the_kvcanary_frame():
    from kvcanary.ops.plan import Plan

    with pytest.raises(ValueError) as info:
        Plan.allocate(0, 1)
    culprit = timing.culprit(info.value)
    assert culprit.startswith("kvcanary.ops._common.check_count (_common.py:"), culprit
    assert "<- kvcanary.ops.plan.allocate (plan.py:" in culprit, culprit
    assert timing.culprit(ValueError("x")).startswith("no kvcanary frame")


def test_cpu_timing_and_copy_bandwidth():
    cpu = torch.device("cpu")
    assert timing.copy_bandwidth(cpu, 1 << 20) > 0
    t = timing.time_step([lambda: torch.randn(64).sum()], cpu, "a sum", batches=3)
    assert t.us > 0 and t.mode.startswith("eager, perf_counter") and t.capture_error is None
    with pytest.raises(ValueError, match="reps and batches must be >= 1, got reps=0"):
        timing.median_us(lambda: None, cpu, 0, 1)


def test_canary_bytes_by_hand():
    identity, partial, sweep8, truth = (next(m for m in MODES if m.name == n)
                                        for n in ("identity", "partial", "sweep8", "truth"))
    shape = StepShape.decode(2, 10)  # 20 prefix entries, 2 written tokens
    # verify 2 * 20 * 36 = 1440; stamp 2 * 56 = 112; written fingerprints recorded 2 * 8 = 16
    assert canary_bytes(shape, identity, 0) == 1440 + 112 + 16
    # + 4 sources x 16 B for each of the 20 prefix and 2 written slots: 22 * 64 = 1408
    assert canary_bytes(shape, partial, 64) == 1440 + 112 + 16 + 1408 == 2976
    # + scatter 2 * 11 * 12 = 264, token checks (20 + 2) * 4 = 88
    assert canary_bytes(shape, truth, 64) == 2976 + 264 + 88
    assert canary_bytes(shape, sweep8, 64, sweep_bytes=8000) == 2976 + 1000


def test_why_missed_names_bytes_or_latency():
    assert why_missed({"per_step_us": 10.0, "canary_bytes_us": 6.0, "canary_bytes": 3e7}).startswith(
        "bytes: the canary must move 30.0 MB per step (6.0 µs")
    assert why_missed({"per_step_us": 10.0, "canary_bytes_us": 1.0, "canary_bytes": 5e6}).startswith(
        "latency: its bytes need 1.0 µs of its 10.0 µs")
