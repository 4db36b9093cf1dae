"""The reference engine's host tier carries the layout signature of the canary whose records it
holds: a canary of another layout (a canary rebuilt over the engine, or another pool sharing the
tier) cannot adopt it, and names both values; one of the same layout adopts it and loads its rows
back clean."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from kvcanary import Canary, CanaryConfig, FingerprintMode, Half, HostMirror
from kvcanary.core.record import RECORD_VERSION
from kvcanary.engine.canary_hooks import attach_canary, pool_geometry, pool_sources
from kvcanary.errors import KVCanaryError

from ._helpers import make_engine, random_prompts

MODEL_ID = "reference-llama layers=2 hidden=64 heads=4 vocab=256 seed=0"
# field -> (the adopting canary's config and geometry changes; the error's "<field> sender .. receiver ..")
CASES = {
    "record_version": ({}, {}, f"record_version sender {RECORD_VERSION + 1} receiver {RECORD_VERSION}"),
    "layers": ({"layers": (1, 0)}, {}, "layers sender (0, 0, 1, 1) receiver (1, 1, 0, 0)"),
    "halves": ({"halves": (Half.V, Half.K)}, {}, "halves sender (K, V, K, V) receiver (V, K, V, K)"),
    "page_size": ({}, {"page_size": 4}, "page_size sender 1 receiver 4"),
    "dtype": ({}, {"kv_dtype": torch.bfloat16}, "dtype sender 'float64' receiver 'bfloat16'"),
    "num_kv_heads": ({}, {"num_kv_heads": 8}, "num_kv_heads sender 2 receiver 8"),
    "head_dim": ({}, {"head_dim": 128}, "head_dim sender 16 receiver 128"),
    "fingerprint": ({"real_kv": FingerprintMode.ALL}, {}, "fingerprint sender PARTIAL receiver ALL"),
    "model": ({}, {"model": "llama-3.1-8b"}, f"model sender '{MODEL_ID}' receiver 'llama-3.1-8b'"),
}


def _offloaded():
    """An engine with a canary whose cached prompts went to the host tier: (engine, its canary, the
    host rows of one offloaded node)."""
    engine, hooks = attach_canary(lambda h: make_engine(hooks=h, num_slots=64, host_tier_slots=128, chunk_size=64),
                                  CanaryConfig())
    shared = random_prompts(seed=9, num=1, min_len=24, max_len=24)[0]
    engine.add_request(shared + [1, 2], 4)
    engine.run_until_done()
    for prompt in random_prompts(seed=10, num=2, min_len=30, max_len=30):
        engine.add_request(prompt, 8)
    engine.run_until_done()
    rows = min((n.host_rows for n in engine.tree.nodes() if n.is_on_host), key=len)  # one node's, in order
    assert rows.numel() >= 24 and hooks.canary.totals.violations == 0
    return engine, hooks.canary, rows


def _canary(engine, canary_changes: dict, geometry_changes: dict) -> Canary:
    config = CanaryConfig(**canary_changes)
    geometry = dataclasses.replace(pool_geometry(engine, engine.config.num_slots), **geometry_changes)
    return Canary(config, geometry, sources=pool_sources(engine, config))


@pytest.mark.parametrize("field", list(CASES))
def test_a_canary_of_another_layout_cannot_adopt_the_host_tier(field):
    canary_changes, geometry_changes, message = CASES[field]
    engine, owner, rows = _offloaded()
    mirror = owner.host_mirror
    assert mirror.signature == owner.signature
    if field == "record_version":  # a tier written by another record layout
        mirror = HostMirror(mirror.rows, dataclasses.replace(mirror.signature, record_version=RECORD_VERSION + 1))
    other = _canary(engine, canary_changes, geometry_changes)
    before = [other.state.records.clone(), other.state.source_tags.clone(), owner.host_rows.clone()]
    with pytest.raises(KVCanaryError, match=rf"^attach_host_tier: signature mismatch: {re.escape(message)} \("):
        other.attach_host_tier(mirror)
    assert other.host_mirror is None
    after = [other.state.records, other.state.source_tags, owner.host_rows]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    with pytest.raises(KVCanaryError, match=r"load_back\(\) before attach_host_tier\(\)"):
        other.load_back(rows, torch.arange(1, rows.numel() + 1))


def test_a_canary_of_the_same_layout_adopts_the_host_tier_and_loads_back_clean():
    engine, owner, rows = _offloaded()
    other = _canary(engine, {}, {})
    assert other.signature == owner.signature and other.signature is not owner.signature
    other.attach_host_tier(owner.host_mirror)
    slots = engine.cache.alloc_slots(rows.numel())  # evicts (offloads) other cached slots to make room
    engine.pool.copy_from_host(rows, slots)  # K/V and the owner's records, verified by the owner
    other.load_back(rows, slots)  # the adopted mirror's rows land in the other canary's records
    report = other.end_step(1)
    assert report.violations == [] and other.flush(2).violations == []
    assert other.counters()["SWEEP"]["checked"] == rows.numel()
    assert torch.equal(other.export_rows(slots), owner.export_rows(slots))
    assert owner.flush(3).violations == [] and owner.totals.violations == 0
    engine.pool.free(slots)
