from __future__ import annotations

import re

import pytest
import torch

from kvcanary.engine import EngineHooks, RequestStatus, SamplerKind
from kvcanary.engine.sampler import oracle_token
from kvcanary.runtime.batch import ForwardBatch

from ._helpers import RecordingHooks, make_engine, random_prompts


def check_batch(engine, batch: ForwardBatch) -> None:
    """The ForwardBatch contract, checked right before the forward."""
    bs, num_tokens = batch.batch_size, batch.num_tokens
    assert batch.req_to_token is engine.pool.req_to_token and batch.req_to_token.dtype == torch.int32
    for name in (
        "req_pool_indices",
        "prefix_lens",
        "extend_lens",
        "input_ids",
        "positions",
        "out_cache_loc",
        "truth_ids",
        "truth_offsets",
    ):
        assert getattr(batch, name).dtype == torch.int64, name
    assert batch.prefix_lens.shape == batch.extend_lens.shape == (bs,) and len(batch.request_ids) == bs
    assert num_tokens == int(batch.extend_lens.sum()) and batch.positions.shape == batch.out_cache_loc.shape
    assert bool((batch.req_pool_indices > 0).all()) and bool((batch.extend_lens > 0).all())
    starts = torch.cumsum(batch.extend_lens, 0) - batch.extend_lens
    offsets = batch.truth_offsets
    assert offsets.shape == (bs + 1,) and int(offsets[0]) == 0 and int(offsets[-1]) == batch.truth_ids.numel()
    for r in range(bs):
        s, n, p = int(starts[r]), int(batch.extend_lens[r]), int(batch.prefix_lens[r])
        row = int(batch.req_pool_indices[r])
        positions = batch.positions[s : s + n]
        assert torch.equal(positions, p + torch.arange(n))
        assert torch.equal(batch.out_cache_loc[s : s + n], batch.req_to_token[row, positions].long())
        # the truth: the request's whole history, or (appends) the rest of it from its start
        truth = batch.truth_ids[int(offsets[r]) : int(offsets[r + 1])].tolist()
        first = int(batch.truth_starts[r]) if batch.truth_starts is not None else 0
        history = engine.requests[batch.request_ids[r]].token_ids
        assert truth == history[first:] and batch.input_ids[s : s + n].tolist() == history[p : p + n]
    assert bool((batch.out_cache_loc >= engine.config.page_size).all()), "a write into the reserved page"
    assert batch.out_cache_loc.unique().numel() == num_tokens, "two tokens written to one slot"


@pytest.mark.parametrize("truth_appends", [None, False])
@pytest.mark.parametrize("page_size", [1, 4])
def test_every_forward_batch_is_consistent(page_size, truth_appends):
    hooks = RecordingHooks()
    engine = make_engine(
        hooks=hooks, page_size=page_size, chunk_size=7, max_tokens_per_step=30, num_slots=128,
        truth_appends=truth_appends,
    )
    starts = []
    hooks.on_before = lambda batch: (check_batch(engine, batch), starts.append(
        None if batch.truth_starts is None else batch.truth_starts.tolist()))
    engine.generate(random_prompts(seed=20, num=8, prefix_len=9), 6)
    assert hooks.names().count("before_forward") == engine.stats.num_steps > 0
    if truth_appends is False:  # whole histories at every step
        assert set(starts) == {None}
        return
    # appends at every step: batches with a new row's whole history (from column 0), and batches
    # whose every request sends only what its row lacks
    assert None not in starts
    assert any(0 in s for s in starts) and any(min(s) > 0 for s in starts)


class _Quiet(RecordingHooks):
    reads_token_truth = False


@pytest.mark.parametrize("seed", [30, 31])
def test_hooks_that_read_no_token_truth_get_none_and_the_same_tokens(seed):
    """The engine builds each forward's token truth only for hooks that read it: without them
    every batch's truth fields are None and no request's truth_len moves, and the engine emits,
    step by step, exactly the tokens it emits with the truth built."""
    runs = {}
    for hooks in (RecordingHooks(), _Quiet()):
        engine = make_engine(hooks=hooks, chunk_size=7, max_tokens_per_step=30, num_slots=96, host_tier_slots=32)
        seen = []
        hooks.on_before = lambda b, e=engine, s=seen: s.append(
            (b.truth_ids, b.truth_offsets, b.truth_starts, [e.requests[r].truth_len for r in b.request_ids]))
        steps = []
        for p in random_prompts(seed=seed, num=10, prefix_len=12):
            engine.add_request(p, 7)
        while engine.has_unfinished:
            steps.append(dict(engine.step().new_tokens))
        runs[hooks.reads_token_truth] = (steps, seen, engine)
    (with_truth, seen_truth, engine_truth), (without, seen_none, engine_none) = runs[True], runs[False]
    assert with_truth == without and len(without) > 5  # every token, at every step
    assert engine_none.stats.num_offloaded_slots > 0  # a host tier in play
    assert engine_truth.token_truth is True and engine_none.token_truth is False
    assert all(ids is None and offsets is None and starts is None and not any(lens)
               for ids, offsets, starts, lens in seen_none)
    assert all(ids is not None and offsets is not None for ids, offsets, _, _ in seen_truth)
    assert any(any(lens) for *_, lens in seen_truth)
    assert EngineHooks.reads_token_truth is False


def test_canary_and_fault_hooks_read_the_token_truth_the_config_asks_for():
    from kvcanary.config import CanaryConfig, Policy
    from kvcanary.engine.canary_hooks import CanaryHooks
    from kvcanary.faults.hooks import FaultHooks

    for config, reads in ((CanaryConfig(), True), (CanaryConfig(truth=False), False),
                          (CanaryConfig(policy=Policy.OFF), False)):
        hooks = CanaryHooks(config)
        assert hooks.reads_token_truth is reads
        assert FaultHooks(hooks, []).reads_token_truth is reads
        assert make_engine(hooks=hooks).token_truth is reads
    assert FaultHooks(EngineHooks(), []).reads_token_truth is False


def test_hook_order_within_steps():
    hooks = RecordingHooks()
    engine = make_engine(hooks=hooks, num_slots=64, host_tier_slots=64, chunk_size=8)
    shared = random_prompts(seed=21, num=4, prefix_len=10)
    for wave in (shared[:2], random_prompts(seed=22, num=2, min_len=30, max_len=30), shared[2:]):
        engine.generate(wave, 6)  # the filler wave pushes the shared prefix to the host
    letter = dict(
        before_forward="B", forward_prologue="P", forward_epilogue="E", after_forward="A", after_step="S",
        before_move="M", on_offload="O", on_load="L", on_free="F"
    )
    trace = "".join(letter[name] for name in hooks.names())
    assert re.fullmatch(r"((MO|ML|F)*BPEAF*S)+", trace), trace
    assert {"O", "L", "F"} <= set(trace)
    steps = [args[0] for name, args in hooks.events if name == "after_step"]
    assert steps == list(range(engine.stats.num_steps))


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefix_cache_on_equals_off(page_size):
    prompts = random_prompts(seed=23, num=8, min_len=2, max_len=20, prefix_len=13)
    off = make_engine(page_size=page_size, enable_prefix_cache=False)
    on = make_engine(page_size=page_size, max_running=2)
    assert on.generate(prompts, 8) == off.generate(prompts, 8)
    assert on.stats.num_prefix_hit_tokens > 0 and off.stats.num_prefix_hit_tokens == 0
    assert on.stats.num_prefill_tokens + on.stats.num_prefix_hit_tokens == off.stats.num_prefill_tokens
    on.check_integrity()


def test_prefix_cache_slots_describe_idle_cached_runs():
    engine = make_engine(page_size=2, chunk_size=64)
    finished = engine.generate(random_prompts(seed=24, num=4, prefix_len=8), 5)
    running = engine.add_request(random_prompts(seed=24, num=1, prefix_len=8)[0] + [7], 5)
    engine.step()
    runs = engine.prefix_cache_slots()
    histories = [engine.requests[i].token_ids for i in finished]
    reader = engine.requests[running]
    read = reader.slots[: reader.num_prefix_cached].tolist()  # locked: not an idle run
    assert reader.num_prefix_cached >= 8
    position_of = {slot: pos for pos, slot in enumerate(read)}
    for slots, tokens, start in ((r.slots, r.token_ids, r.start_position) for r in runs):
        assert slots.dtype == torch.int64 and slots.numel() == len(tokens) > 0 and start % 2 == 0
        assert any(tuple(h[start : start + len(tokens)]) == tuple(tokens) for h in histories)
        for i, slot in enumerate(slots.tolist()):
            assert slot not in position_of, f"slot {slot} listed twice or read by a running request"
            position_of[slot] = start + i
    for run in runs:  # the predecessor is the slot of the previous position, cached or read
        if run.start_position == 0:
            assert run.prev_slot == -1
        else:
            assert position_of[run.prev_slot] == run.start_position - 1


def fresh_runs(engine) -> list[tuple]:
    """The idle cached runs made from the tree as it is now, nothing kept."""
    root, out = engine.tree.root, []
    for node in engine.tree.nodes():
        if node.slots is None or node.lock_count:
            continue
        prev = int(node.parent.slots[-1]) if node.parent is not root else -1
        out.append((node.slots.tolist(), tuple(node.key), node.start, prev))
    return out


@pytest.mark.parametrize("seed", [31, 32, 33])
def test_prefix_cache_slots_kept_runs_match_fresh_ones(seed):
    """The runs kept on the nodes between calls equal runs made afresh at every step, through
    splits (prompts that diverge inside a cached node), evictions (a small pool with a host tier),
    and in-place writes to a node's or its parent's slots; a node that did not change hands back
    the very run it kept."""
    gen = torch.Generator().manual_seed(seed)
    engine = make_engine(page_size=2, chunk_size=16, num_slots=64, host_tier_slots=64)
    base = torch.randint(0, 256, (24,), generator=gen).tolist()
    pending = []
    for _ in range(14):  # prefixes of the same base, cut at random points: nodes split where they diverge
        cut = int(torch.randint(2, 24, (1,), generator=gen))
        pending.append(base[:cut] + torch.randint(0, 256, (int(torch.randint(3, 12, (1,), generator=gen)),),
                                                  generator=gen).tolist())
    steps = kept = written = 0
    while pending or engine.has_unfinished:
        if pending and int(torch.randint(0, 3, (1,), generator=gen)) == 0:
            engine.add_request(pending.pop(), int(torch.randint(1, 6, (1,), generator=gen)))
        if engine.has_unfinished:
            engine.step()
        first = engine.prefix_cache_slots()
        assert [(r.slots.tolist(), tuple(r.token_ids), r.start_position, r.prev_slot) for r in first] == \
            fresh_runs(engine)
        again = engine.prefix_cache_slots()
        assert all(a is b for a, b in zip(first, again, strict=True))  # nothing changed: the kept runs
        kept += len(again)
        idle = [n for n in engine.tree.nodes() if n.slots is not None and not n.lock_count
                and n.parent is not engine.tree.root and n.parent.slots is not None]
        if idle and steps % 3 == 0:  # a parent's last slot written in place: its child's predecessor moves
            node = idle[int(torch.randint(0, len(idle), (1,), generator=gen))]
            node.parent.slots[-1] = node.parent.slots[-1].item() ^ 1
            runs = engine.prefix_cache_slots()
            assert [(r.slots.tolist(), tuple(r.token_ids), r.start_position, r.prev_slot) for r in runs] == \
                fresh_runs(engine)
            node.parent.slots[-1] = node.parent.slots[-1].item() ^ 1
            written += 1
        steps += 1
    assert kept > 0 and written > 0


def test_recompute_quarantines_and_reprefills():
    prompts = random_prompts(seed=25, num=3, min_len=10, max_len=20)
    expected = make_engine().generate(prompts, 8)
    hooks = RecordingHooks()
    engine = make_engine(hooks=hooks)
    ids = [engine.add_request(p, 8) for p in prompts]
    engine.step()
    engine.step()
    victim = engine.requests[ids[1]]
    bad = int(victim.slots[2])
    engine.pool.k_buffers[0][bad].view(torch.uint8)[0, 6] ^= 0x10
    assert engine.recompute([ids[1]], [bad]) == [ids[1]]
    assert victim.status is RequestStatus.PREEMPTED and victim.num_cached == 0 and not victim.is_active
    engine.check_integrity()
    # quarantined while its reader held it, retired when the retraction freed it (its incidents close)
    assert [args[0].tolist() for name, args in hooks.events if name == "on_retire"] == [[bad]]
    hooks.events.clear()
    while engine.has_unfinished:
        engine.step()
        engine.check_integrity()
        assert all(bad not in r.slots.tolist() for r in engine.requests.values())
    for name, args in hooks.events:  # the quarantined slot is never written or freed again
        touched = (
            args[0].out_cache_loc if name == "before_forward" else args[0] if name == "on_free" else None
        )
        assert touched is None or bad not in touched.tolist()
    assert {i: engine.output_ids(i) for i in ids} == expected
    assert engine.stats.num_recomputes == 1 and engine.stats.num_quarantined_slots == 1


def test_recompute_drops_cached_nodes_and_retracts_their_readers():
    prompts = random_prompts(seed=26, num=2, min_len=6, max_len=6, prefix_len=12)
    engine = make_engine(chunk_size=64)
    engine.generate(prompts[:1], 4)
    reader = engine.add_request(prompts[1], 4)
    engine.step()
    assert engine.requests[reader].num_prefix_cached == 12
    bad = int(engine.requests[reader].slots[5])  # a shared, cached prefix slot
    assert engine.recompute([], torch.tensor([bad])) == [reader]
    engine.check_integrity()
    assert all(bad not in run.slots.tolist() for run in engine.prefix_cache_slots())
    engine.run_until_done()
    engine.check_integrity()
    assert engine.output_ids(reader) == make_engine().generate(prompts[1:], 4)[0]
    with pytest.raises(ValueError, match="bad_slots"):
        engine.recompute([], [10**6])


def test_step_results_and_idle_step():
    engine = make_engine()
    assert engine.step().step_index == -1
    a = engine.add_request([5, 6, 7], 2)
    first = engine.step()
    assert first.step_index == 0 and first.request_ids == (a,) and list(first.new_tokens) == [a]
    assert first.logits[a].shape == (256,) and first.finished_ids == ()
    second = engine.step()
    assert second.finished_ids == (a,) and engine.output_ids(a) == [first.new_tokens[a], second.new_tokens[a]]
    assert not engine.has_unfinished and engine.stats.num_decode_tokens == 1
    assert engine.stats.num_prefill_tokens == 3


def test_oracle_sampler_is_a_hash_of_request_and_position():
    prompts = random_prompts(seed=27, num=3)
    outputs = make_engine(sampler=SamplerKind.ORACLE, chunk_size=5).generate(prompts, 6)
    for rid, out in outputs.items():
        n = len(prompts[rid])
        assert out == [oracle_token(rid, n + i, 256) for i in range(6)]
    assert len({t for out in outputs.values() for t in out}) > 6


def test_default_hooks_are_no_ops():
    hooks = EngineHooks()
    assert make_engine(hooks=hooks).hooks is hooks
    assert make_engine().generate([[1, 2, 3]], 3) == make_engine(hooks=hooks).generate([[1, 2, 3]], 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_matches_cpu():
    prompts = random_prompts(seed=28, num=6, prefix_len=10)
    cpu = make_engine(page_size=4, host_tier_slots=64, num_slots=128).generate(prompts, 8)
    engine = make_engine(page_size=4, host_tier_slots=64, num_slots=128, device="cuda")
    assert engine.pool.host_k.is_pinned() and engine.pool.k_buffers[0].is_cuda
    assert engine.generate(prompts, 8) == cpu
    engine.check_integrity()
