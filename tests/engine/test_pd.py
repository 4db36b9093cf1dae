"""Prefill/decode split: a real copy of K/V and canary rows between two engines' pools."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from kvcanary.config import CanaryConfig
from kvcanary.core.record import RECORD_VERSION, FingerprintMode, Half
from kvcanary.engine.canary_hooks import attach_canary
from kvcanary.engine.config import EngineConfig, ModelConfig
from kvcanary.engine.engine import Engine
from kvcanary.engine.pd import KVTransfer
from kvcanary.engine.request import RequestStatus
from kvcanary.engine.workload import WorkloadConfig, builtin_workload, engine_config_for
from kvcanary.errors import KVCanaryError
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


# field -> (decode side's canary config, engine config, model changes; the error's "<field> sender .. receiver ..")
SIGNATURE_CASES = {
    "record_version": ({}, {}, {}, f"record_version sender {RECORD_VERSION + 1} receiver {RECORD_VERSION}"),
    "layers": ({"layers": (1, 0)}, {}, {}, "layers sender (0, 0, 1, 1) receiver (1, 1, 0, 0)"),  # the order counts
    "halves": ({"halves": (Half.V, Half.K)}, {}, {}, "halves sender (K, V, K, V) receiver (V, K, V, K)"),
    "page_size": ({}, {"page_size": 2}, {}, "page_size sender 1 receiver 2"),
    "dtype": ({}, {}, {"dtype": torch.float32}, "dtype sender 'float64' receiver 'float32'"),
    "num_kv_heads": ({}, {}, {"num_kv_heads": 1}, "num_kv_heads sender 2 receiver 1"),
    "head_dim": ({}, {}, {"head_dim": 8}, "head_dim sender 16 receiver 8"),
    "fingerprint": ({"real_kv": FingerprintMode.ALL}, {}, {}, "fingerprint sender PARTIAL receiver ALL"),
    "model": ({}, {}, {"seed": 5}, "model sender 'reference-llama layers=2 hidden=64 heads=4 vocab=256 seed=4' "
                                   "receiver 'reference-llama layers=2 hidden=64 heads=4 vocab=256 seed=5'"),
}


def _decode_state(decode: Engine, canary) -> list[torch.Tensor]:
    return [canary.state.records.clone(), canary.state.source_tags.clone(),
            *[b.clone() for b in decode.pool.k_buffers + decode.pool.v_buffers]]


@pytest.mark.parametrize("field", list(SIGNATURE_CASES))
def test_receive_refuses_records_of_another_layout_before_anything_is_written(field):
    """A decode side configured differently in one layout field: the payload is refused naming both
    values, and the decode engine is untouched: no slot allocated, no K/V, record or tree entry."""
    canary_changes, engine_changes, model_changes, message = SIGNATURE_CASES[field]
    prefill, p_hooks = attach_canary(lambda h: Engine(MODEL, CONFIG, h), CanaryConfig())
    decode_model = dataclasses.replace(MODEL, **model_changes)
    decode, d_hooks = attach_canary(lambda h: Engine(decode_model, dataclasses.replace(CONFIG, **engine_changes), h),
                                    CanaryConfig(**canary_changes))
    transfer = KVTransfer(prefill, decode, p_hooks.canary, d_hooks.canary)
    prompt = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(6)).tolist()
    prefill.generate([prompt], 1)
    payload = transfer.send(0, prompt)
    if field == "record_version":  # a prefill side of another record layout: its payload says so
        payload = dataclasses.replace(payload, signature=dataclasses.replace(payload.signature,
                                                                             record_version=RECORD_VERSION + 1))
    before, free = _decode_state(decode, d_hooks.canary), decode.pool.num_free_slots
    with pytest.raises(KVCanaryError, match=rf"^KVTransfer.receive: signature mismatch: {re.escape(message)} \("):
        transfer.receive(payload)
    assert all(torch.equal(a, b) for a, b in zip(before, _decode_state(decode, d_hooks.canary), strict=True))
    assert decode.pool.num_free_slots == free and decode.tree.match(prompt)[1] == 0
    assert transfer.stats.requests == 0 and transfer.stats.dropped == 0
    decode.check_integrity()


def test_receive_of_the_same_layout_lands_and_verifies_clean():
    """The twin: the payload carries the prefill canary's signature, equal to the decode canary's;
    it lands, the landed slots verify clean on arrival and in the decode request's HEAD."""
    transfer, p_hooks, d_hooks = _pair()
    prompt = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(6)).tolist()
    transfer.prefill.generate([prompt], 1)
    payload = transfer.send(0, prompt)
    assert payload.signature is p_hooks.canary.signature and payload.signature == d_hooks.canary.signature
    dst = transfer.receive(payload)
    assert dst is not None and torch.equal(d_hooks.canary.export_rows(dst), payload.records)
    transfer.decode.add_request([*prompt, 9], 2)
    transfer.decode.run_until_done()
    assert d_hooks.reports == [] and d_hooks.canary.totals.violations == 0
    assert d_hooks.canary.counters()["SWEEP"]["checked"] == len(prompt)
    transfer.decode.check_integrity()
