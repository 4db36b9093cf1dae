from __future__ import annotations

import torch

from kvcanary.engine import RequestStatus

from ._helpers import RecordingHooks, kv_bytes, make_engine, random_prompts


def run_shared_prefix_workload(engine, shared, others):
    """A request with ``shared`` prefix, then ``others`` that push it out of the device, then a
    second request with the same prefix. Returns (first id, second id, K/V bytes of the prefix
    after the first request, second request's prefix slots once admitted)."""
    first = engine.add_request(shared + [1, 2], 4)
    engine.run_until_done()
    node, n = engine.tree.match(shared)
    assert n == len(shared)
    before = kv_bytes(engine, torch.cat([x.slots for x in node.path()]))
    for prompt in others:
        engine.add_request(prompt, 8)
    engine.run_until_done()
    second = engine.add_request(shared + [3], 4)
    engine.step()
    admitted = engine.requests[second].slots[: len(shared)].clone()
    engine.run_until_done()
    return first, second, before, admitted


def test_offload_and_load_back_round_trip_bytes():
    hooks = RecordingHooks()
    engine = make_engine(hooks=hooks, num_slots=64, host_tier_slots=128, chunk_size=64)
    shared = random_prompts(seed=9, num=1, min_len=24, max_len=24)[0]
    others = random_prompts(seed=10, num=2, min_len=30, max_len=30)
    first, second, before, admitted = run_shared_prefix_workload(engine, shared, others)
    engine.check_integrity()
    assert engine.stats.num_offloaded_slots >= len(shared) and engine.stats.num_loaded_slots >= len(shared)
    assert engine.stats.num_prefix_hit_tokens >= len(shared)
    assert torch.equal(kv_bytes(engine, admitted), before), "loaded-back K/V differs from what was offloaded"
    # each copy is announced right after it happens, and an offloaded slot is freed only after its copy
    offloaded = set()
    for name, args in hooks.events:
        if name == "on_offload":
            offloaded |= set(args[0].tolist())
        if name == "on_load":
            assert args[0].numel() == args[1].numel()
    assert offloaded, "no on_offload hook was called"
    reference = make_engine(enable_prefix_cache=False).generate(
        [shared + [1, 2], *others, shared + [3]], [4, 8, 8, 4]
    )
    assert engine.output_ids(first) == reference[0] and engine.output_ids(second) == reference[3]


def test_offload_hook_precedes_free_of_the_same_slots():
    hooks = RecordingHooks()
    engine = make_engine(hooks=hooks, num_slots=48, host_tier_slots=48, chunk_size=64)
    run_shared_prefix_workload(
        engine,
        random_prompts(seed=12, num=1, min_len=16, max_len=16)[0],
        random_prompts(seed=13, num=2, min_len=24, max_len=24),
    )
    pending: set[int] = set()
    for name, args in hooks.events:
        if name == "on_offload":
            pending |= set(args[0].tolist())
        elif name == "on_free":
            pending -= set(args[0].tolist())
    assert not pending, f"slots offloaded but never freed: {sorted(pending)[:8]}"


def test_full_host_tier_drops_lru_host_leaves():
    engine = make_engine(num_slots=48, host_tier_slots=30, chunk_size=64)
    for prompt in random_prompts(seed=14, num=8, min_len=14, max_len=20):
        engine.add_request(prompt, 6)
        engine.run_until_done()
        engine.check_integrity()
    assert engine.stats.num_offloaded_slots > 30 and engine.stats.num_dropped_host_slots > 0
    assert all(r.status is RequestStatus.FINISHED for r in engine.requests.values())


def test_host_tier_outputs_equal_no_cache():
    """Two waves sharing a prefix, unrelated filler in between: the prefix goes to the host and back."""
    wave1, wave2 = (
        random_prompts(seed=15, num=8, min_len=4, max_len=12, prefix_len=12)[i::2] for i in (0, 1)
    )
    filler = random_prompts(seed=16, num=4, min_len=20, max_len=30)
    expected = make_engine(enable_prefix_cache=False).generate(wave1 + filler + wave2, 10)
    engine = make_engine(page_size=4, num_slots=96, host_tier_slots=96, max_running=3)
    outputs = {}
    for wave in (wave1, filler, wave2):
        outputs |= engine.generate(wave, 10)
        engine.check_integrity()
    assert list(outputs.values()) == list(expected.values())
    assert engine.stats.num_offloaded_slots > 0 and engine.stats.num_loaded_slots > 0
