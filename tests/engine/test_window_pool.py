"""Sliding-window layers: the window pool, its full-slot -> window-slot table, the window canary."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcanary.config import CanaryConfig
from kvcanary.core.record import PoolKind
from kvcanary.engine.canary_hooks import attach_canary, window_runs
from kvcanary.engine.config import EngineConfig, ModelConfig
from kvcanary.engine.engine import Engine
from kvcanary.engine.pool import window_pool_slots
from kvcanary.engine.request import RequestStatus
from kvcanary.errors import ConfigError
from kvcanary.runtime.sweep import SweepRun

HYBRID = ModelConfig(num_layers=4, sliding_window=6, window_layers=(0, 2), seed=3)
# a window pool far smaller than the full pool: windows slide and window slots are reused
TIGHT = EngineConfig(num_slots=384, max_rows=9, max_ctx=96, chunk_size=16, max_tokens_per_step=48, max_running=4,
                     window_slots=72, host_tier_slots=128)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 256, (24,), generator=g).tolist()
    return [system + torch.randint(0, 256, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize(("field", "value", "message"), [
    ("window_layers", (2, 0), "in increasing order"),
    ("window_layers", (0, 4), r"\[0, 4\)"),
    ("window_layers", (0, 1, 2, 3), "not every layer"),
    ("sliding_window", 0, ">= 1 with window_layers"),
])
def test_model_config_rejects_bad_windows(field, value, message):
    with pytest.raises(ConfigError, match=f"ModelConfig.{field} must be .*{message}"):
        dataclasses.replace(HYBRID, **{field: value})
    with pytest.raises(ConfigError, match="ModelConfig.sliding_window must be >= 1 with window_layers, 0 without"):
        ModelConfig(sliding_window=4)
    with pytest.raises(ConfigError, match="EngineConfig.window_slots must be 0 .* or an int >= 2, got 1"):
        EngineConfig(window_slots=1)


def test_window_pool_is_smaller_and_window_layers_live_there():
    engine = Engine(HYBRID, dataclasses.replace(TIGHT, window_slots=0))
    window = engine.pool.window
    assert window.num_slots == window_pool_slots(HYBRID, engine.config) < engine.config.num_slots
    assert window.layers == (0, 2) and engine.pool.full_layers == (1, 3)
    assert engine.pool.k_buffers[0] is window.k_buffers[0] and engine.pool.k_buffers[1].shape[0] == TIGHT.num_slots
    assert window.lut.dtype == torch.int64 and window.lut.shape == (TIGHT.num_slots,)
    assert Engine(ModelConfig(), TIGHT).pool.window is None


@pytest.mark.parametrize("page_size", [1, 4])
def test_translation_invariants_hold_every_step_while_windows_slide(page_size):
    """After every step: window-slot conservation, the device table equals its host mirror, no free
    full slot keeps a window slot, and every running request's last ``window`` positions hold
    distinct window slots. Windows slide, window slots are reused, numbers differ from full slots."""
    engine = Engine(HYBRID, dataclasses.replace(TIGHT, page_size=page_size))
    window, w = engine.pool.window, HYBRID.sliding_window
    for i, p in enumerate(_prompts(14)):
        engine.add_request(p, 6 + i % 5)
    while engine.has_unfinished:
        engine.step()
        engine.check_integrity()
        for req in engine.scheduler.running:
            if req.status is RequestStatus.RUNNING and req.num_cached:
                lo = max(req.num_cached - w, 0)
                full = engine.pool.req_to_token[req.row, lo : req.num_cached].to(torch.int64)
                win = window.lut[full]
                assert bool((win > 0).all()), f"request {req.request_id}: window positions lost their slots"
                assert win.unique().numel() == win.numel()
    c = window.counters()
    assert c["translated_positions"] > 0 and c["slid_out_positions"] > 0 and c["reused_window_slots"] > 0
    assert c["mapped_positions"] > window.num_slots  # more positions than window slots: slots were reused


def test_small_window_pool_changes_no_output():
    """The tokens of a tiny window pool (heavy sliding and reuse) equal those of one that never
    slides: the window layers read the same K/V through a different table."""
    prompts = _prompts(10, seed=5)
    big = Engine(HYBRID, dataclasses.replace(TIGHT, window_slots=TIGHT.num_slots)).generate(prompts, 8)
    small = Engine(HYBRID, TIGHT).generate(prompts, 8)
    assert small == big


def test_window_layout_masks_keys_outside_the_window():
    """Query at position t of a window-W layer sees keys t-W < j <= t, read through the table;
    keys before prefix_len - W + 1 are not read at all (slot 0, masked)."""
    from kvcanary.engine.attention import AttentionLayout
    from kvcanary.runtime.batch import ForwardBatch

    w, prefix, extend = 4, 10, 3
    rtt = torch.zeros(2, 16, dtype=torch.int32)
    rtt[1, : prefix + extend] = torch.arange(20, 20 + prefix + extend, dtype=torch.int32)
    lut = torch.zeros(40, dtype=torch.int64)
    lut[20:33] = torch.arange(100, 113)
    batch = ForwardBatch(torch.tensor([1]), torch.tensor([prefix]), torch.tensor([extend]), rtt,
                         torch.tensor([5, 6, 7]), torch.arange(prefix, prefix + extend), rtt[1, prefix:13].long())
    layout = AttentionLayout.from_batch(batch, w, lut)
    for col, t in enumerate(range(prefix, prefix + extend)):
        seen = torch.nonzero(layout.mask[0, col]).flatten().tolist()
        assert seen == list(range(t - w + 1, t + 1))
    assert layout.key_slots[0, : prefix - w + 1].tolist() == [0] * (prefix - w + 1)
    assert layout.key_slots[0, prefix - w + 1 : prefix + extend].tolist() == list(range(107, 113))


def test_clean_run_reports_zero_violations_and_exercises_the_window():
    engine, hooks = attach_canary(lambda h: Engine(HYBRID, TIGHT, h), CanaryConfig(sweep_interval=2))
    assert hooks.window_canary.pool is PoolKind.SWA and hooks.window_canary.window == HYBRID.sliding_window
    for i, p in enumerate(_prompts(14, seed=1)):
        engine.add_request(p, 6 + i % 5)
    engine.run_until_done()
    assert hooks.reports == []
    report = hooks.window_report()
    assert report["violations"] == 0 and report["verified_slots"] > 0 and report["sweeps"] > 0
    assert report["translated_positions"] > 0 and report["slid_out_positions"] > 0
    assert report["reused_window_slots"] > 0 and report["dropped_cached_positions"] > 0
    assert report["protected_slots"] <= report["mapped_positions"]  # loads map window slots too


def test_window_runs_keep_only_resident_slots():
    lut = torch.zeros(16, dtype=torch.int64)
    lut[[3, 4, 6, 7, 9]] = torch.tensor([11, 12, 13, 14, 15])
    runs = [SweepRun(torch.tensor([3, 4, 5, 6, 7]), [1, 2, 3, 4, 5], 10, prev_slot=9),
            SweepRun(torch.tensor([8, 5]), None, 0, prev_slot=-1)]
    out = window_runs(runs, lut)
    assert [(r.slots.tolist(), r.token_ids, r.start_position, r.prev_slot) for r in out] == [
        ([11, 12], [1, 2], 10, 15), ([13, 14], [4, 5], 13, -1)]


def test_multi_turn_prefix_is_reused_with_its_window():
    """A follow-up turn (the previous turn's tokens, then more) reuses the whole cached prefix: its
    last ``window`` positions still hold window slots, and the window canary verifies them."""
    engine, hooks = attach_canary(lambda h: Engine(HYBRID, TIGHT, h), CanaryConfig(sweep_interval=1))
    first = _prompts(1, seed=11)[0]
    rid = engine.add_request(first, 12)
    engine.run_until_done()
    turn = engine.requests[rid].token_ids
    hits = engine.stats.num_prefix_hit_tokens
    engine.generate([[*turn, 5, 6, 7]], 4)
    assert engine.stats.num_prefix_hit_tokens - hits == len(turn) - 1  # every computed token of the first turn
    assert hooks.reports == [] and hooks.window_canary.counters()["HEAD"]["checked"] > 0
    engine.check_integrity()


def _window_kv_by_position(engine: Engine, tokens: list[int]) -> torch.Tensor:
    """Window K of layer 0 for each position of the cached ``tokens`` that has a window slot."""
    node, length = engine.tree.match(tokens)
    assert length == len(tokens) and not any(n.is_on_host for n in node.path())
    win = engine.pool.window.translate(torch.cat([n.slots for n in node.path()]))
    return engine.pool.k_buffers[0][win[win > 0]], win > 0


def test_window_kv_and_records_travel_with_offload_and_load_back():
    """Offloading a cached node takes its window K/V (and window records) to the host rows; the
    load-back gives the positions window slots again, byte-equal, verified as they land, and
    the follow-up request reuses the prefix."""
    engine, hooks = attach_canary(lambda h: Engine(HYBRID, TIGHT, h), CanaryConfig())
    rid = engine.add_request(_prompts(1, seed=13)[0], 3)
    engine.run_until_done()
    cached = engine.requests[rid].token_ids[:-1]
    before, had = _window_kv_by_position(engine, cached)
    assert bool(had[-HYBRID.sliding_window:].all())
    engine.cache.evict(TIGHT.num_slots)
    assert engine.stats.num_offloaded_slots == len(cached) and engine.pool.window.counters()["resident_positions"] == 0
    hits, swept = engine.stats.num_prefix_hit_tokens, hooks.window_canary.counters()["SWEEP"]["checked"]
    engine.generate([[*cached, 1, 2]], 2)
    assert engine.stats.num_prefix_hit_tokens - hits == len(cached) and engine.stats.num_loaded_slots == len(cached)
    hooks.window_canary.end_step(engine.step_index)
    assert hooks.window_canary.counters()["SWEEP"]["checked"] - swept >= HYBRID.sliding_window
    after, has = _window_kv_by_position(engine, cached)
    assert torch.equal(has[had], torch.ones(int(had.sum()), dtype=torch.bool))
    w = HYBRID.sliding_window
    assert torch.equal(after[-w:].view(torch.uint8), before[-w:].view(torch.uint8))
    assert hooks.reports == []
    engine.check_integrity()
