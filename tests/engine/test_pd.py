"""Prefill/decode split: a real copy of K/V and canary rows between two engines' pools."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcanary.config import CanaryConfig
from kvcanary.engine.canary_hooks import attach_canary
from kvcanary.engine.config import EngineConfig, ModelConfig
from kvcanary.engine.engine import Engine
from kvcanary.engine.pd import KVTransfer
from kvcanary.engine.request import RequestStatus
from kvcanary.engine.workload import WorkloadConfig, builtin_workload, engine_config_for
from kvcanary.runs.driver import run_workload

MODEL = ModelConfig(seed=4)
CONFIG = EngineConfig(num_slots=256, max_rows=9, max_ctx=96, chunk_size=16, max_running=4, host_tier_slots=64)


def _pair(prefill_config: EngineConfig = CONFIG, decode_config: EngineConfig = CONFIG):
    prefill, p_hooks = attach_canary(lambda h: Engine(MODEL, prefill_config, h), CanaryConfig())
    decode, d_hooks = attach_canary(lambda h: Engine(MODEL, decode_config, h), CanaryConfig())
    return KVTransfer(prefill, decode, p_hooks.canary, d_hooks.canary), p_hooks, d_hooks


def test_relocation_round_trip_is_byte_equal():
    """Every layer's K and V and the canary rows land byte-equal in slots the decode engine chose
    (other slot numbers: its pool is already partly used), through host memory, not shared storage."""
    transfer, p_hooks, d_hooks = _pair()
    decode = transfer.decode
    decode.generate([torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(1)).tolist()], 3)
    prompt = torch.randint(0, 256, (29,), generator=torch.Generator().manual_seed(2)).tolist()
    transfer.prefill.generate([prompt], 1)
    payload = transfer.send(0, prompt)
    assert payload.k.device.type == "cpu" and payload.k.shape[:2] == (MODEL.num_layers, len(prompt))
    dst = transfer.receive(payload)
    src = payload.src_slots
    assert dst.numel() == src.numel() and not torch.equal(dst, src)
    for layer in range(MODEL.num_layers):
        for a, b in ((transfer.prefill.pool.k_buffers[layer], decode.pool.k_buffers[layer]),
                     (transfer.prefill.pool.v_buffers[layer], decode.pool.v_buffers[layer])):
            assert torch.equal(a[src].view(torch.uint8), b[dst].view(torch.uint8))
            assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert torch.equal(p_hooks.canary.state.records[src], d_hooks.canary.state.records[dst])
    d_hooks.canary.end_step(0)
    assert d_hooks.canary.counters()["SWEEP"]["checked"] == len(prompt)  # verified on arrival
    assert d_hooks.reports == [] and d_hooks.canary.totals.violations == 0
    # the decode request finds them in its prefix cache and its first HEAD verifies them again
    hits = decode.stats.num_prefix_hit_tokens
    decode.add_request([*prompt, 7], 3)
    decode.run_until_done()
    assert decode.stats.num_prefix_hit_tokens - hits == len(prompt) and d_hooks.canary.totals.violations == 0
    assert d_hooks.canary.counters()["HEAD"]["checked"] >= len(prompt)
    decode.check_integrity()


def test_receive_without_room_drops_the_payload():
    transfer, _, _ = _pair(decode_config=dataclasses.replace(CONFIG, num_slots=32, host_tier_slots=0))
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    transfer.prefill.generate([prompt], 1)
    assert transfer.receive(transfer.send(0, prompt)) is None and transfer.stats.dropped == 1


def test_transfer_refuses_window_models_and_missing_prefix_cache():
    hybrid = ModelConfig(num_layers=4, sliding_window=4, window_layers=(1,))
    with pytest.raises(ValueError, match="full-attention pools only"):
        KVTransfer(Engine(hybrid, CONFIG), Engine(hybrid, CONFIG), None, None)
    no_cache = dataclasses.replace(CONFIG, enable_prefix_cache=False, host_tier_slots=0)
    with pytest.raises(ValueError, match="enable_prefix_cache=True"):
        KVTransfer(Engine(MODEL, no_cache), Engine(MODEL, CONFIG), None, None)


def test_split_run_is_clean_and_generates_what_one_engine_does():
    """The built-in workload through the split: no violation on either side, every prompt
    transferred, and (the model is batch-invariant) the same tokens as one engine."""
    workload = builtin_workload(WorkloadConfig(num_requests=16, max_new_tokens=6, seed=2))
    config = engine_config_for(workload)
    prefill, p_hooks = attach_canary(lambda h: Engine(MODEL, config, h), CanaryConfig(sweep_interval=2))
    decode, d_hooks = attach_canary(lambda h: Engine(MODEL, config, h), CanaryConfig(sweep_interval=2))
    transfer = KVTransfer(prefill, decode, p_hooks.canary, d_hooks.canary)
    counts = run_workload(transfer, workload)
    assert p_hooks.reports == [] and d_hooks.reports == []
    assert transfer.stats.requests + transfer.stats.dropped == 16 and transfer.stats.requests > 0
    assert decode.stats.num_prefix_hit_tokens >= transfer.stats.slots - transfer.stats.duplicate_slots
    assert d_hooks.canary.counters()["SWEEP"]["checked"] >= transfer.stats.slots
    single = Engine(MODEL, config)
    ids = run_workload(single, workload).request_ids
    compared = 0
    for i, (one, two) in enumerate(zip(ids, counts.request_ids, strict=True)):
        a, b = single.requests[one], decode.requests[two]
        if a.status is RequestStatus.FINISHED and b.status is RequestStatus.FINISHED:
            assert a.output_ids == [b.prompt_ids[-1], *b.output_ids], f"request {i}"
            compared += 1
    assert compared >= 12
    prefill.check_integrity()
    decode.check_integrity()
