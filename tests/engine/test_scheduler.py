from __future__ import annotations

import pytest
import torch

from kvcanary.engine import RequestStatus

from ._helpers import make_engine, random_prompts


def test_budget_chunk_and_running_limits():
    engine = make_engine(chunk_size=6, max_tokens_per_step=20, max_running=3)
    for prompt in random_prompts(seed=5, num=6, min_len=10, max_len=30):
        engine.add_request(prompt, 5)
    while engine.has_unfinished:
        batch = engine.step().batch
        assert int(batch.extend_lens.sum()) <= 20 and int(batch.extend_lens.max()) <= 6
        assert batch.batch_size <= 3 and len(engine.scheduler.running) <= 3
        engine.check_integrity()
    assert all(
        r.status is RequestStatus.FINISHED and len(r.output_ids) == 5 for r in engine.requests.values()
    )


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_preemption_keeps_greedy_outputs(page_size, prefix_cache):
    prompts = random_prompts(seed=6, num=6, min_len=8, max_len=20, prefix_len=4)
    expected = make_engine(page_size=page_size).generate(prompts, 16)
    engine = make_engine(page_size=page_size, num_slots=64, enable_prefix_cache=prefix_cache)
    ids = [engine.add_request(p, 16) for p in prompts]
    while engine.has_unfinished:
        engine.step()
        engine.check_integrity()
    assert engine.stats.num_preemptions > 0
    assert {i: engine.output_ids(i) for i in ids} == expected


def test_preempted_request_requeues_at_the_front_and_re_prefills():
    engine = make_engine(num_slots=48, chunk_size=64)
    a, b = (engine.add_request(p, 20) for p in random_prompts(seed=7, num=2, min_len=12, max_len=12))
    statuses = set()
    while engine.has_unfinished:
        engine.step()
        statuses.add(engine.requests[b].status)
        if engine.requests[b].status is RequestStatus.PREEMPTED:
            assert engine.scheduler.waiting[0].request_id == b and not engine.requests[b].is_active
            assert engine.requests[b].num_cached == 0
    assert RequestStatus.PREEMPTED in statuses and engine.stats.num_preemptions >= 1
    assert engine.requests[a].status is engine.requests[b].status is RequestStatus.FINISHED


def test_abort_waiting_and_running_keeps_integrity():
    engine = make_engine(max_running=2)
    ids = [engine.add_request(p, 10) for p in random_prompts(seed=8, num=4)]
    engine.step()
    engine.step()
    assert engine.abort(ids[0]) and engine.abort(ids[3])  # running, waiting
    assert not engine.abort(ids[0])
    engine.check_integrity()
    engine.run_until_done()
    engine.check_integrity()
    statuses = [engine.requests[i].status for i in ids]
    assert statuses == [
        RequestStatus.ABORTED,
        RequestStatus.FINISHED,
        RequestStatus.FINISHED,
        RequestStatus.ABORTED,
    ]
    assert (
        engine.stats.num_aborts == 2
        and engine.pool.num_free_slots + sum(len(r.slots) for r in engine.prefix_cache_slots())
        == engine.config.num_usable_slots
    )


@pytest.mark.parametrize("page_size, host", [(1, 0), (4, 0), (1, 24), (4, 32)])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_schedules_conserve_memory(page_size, host, seed):
    """Random adds, aborts and steps on a small pool: conservation holds after every operation."""
    gen = torch.Generator().manual_seed(100 + seed)
    engine = make_engine(
        page_size=page_size,
        num_slots=96,
        max_ctx=64,
        chunk_size=8,
        max_tokens_per_step=24,
        max_running=5,
        host_tier_slots=host,
    )
    prefixes = random_prompts(seed=seed, num=3, min_len=4, max_len=16)
    for _ in range(120):
        op = int(torch.randint(0, 10, (1,), generator=gen))
        if op < 3:
            prefix = prefixes[int(torch.randint(0, 3, (1,), generator=gen))]
            tail = torch.randint(
                0, 256, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen
            ).tolist()
            engine.add_request(prefix + tail, int(torch.randint(1, 16, (1,), generator=gen)))
        elif op == 3 and engine.requests:
            ids = list(engine.requests)
            engine.abort(ids[int(torch.randint(0, len(ids), (1,), generator=gen))])
        else:
            engine.step()
        engine.check_integrity()
    engine.run_until_done()
    engine.check_integrity()
    assert engine.stats.num_evicted_slots > 0 and engine.stats.num_prefix_hit_tokens > 0
    if host:
        assert engine.stats.num_offloaded_slots > 0


def test_after_a_step_with_drafts_every_token_but_the_last_is_computed():
    """Speculative decoding: whatever part of its drafts a request's step accepted (all, some,
    none, or the request finishing partway through them), the step leaves exactly its last token
    uncomputed (``num_cached == num_tokens - 1``), and a request that finishes enters the prefix
    cache with that count: no accepted token's K/V computed again, and none taken as computed,
    or cached, that was not."""
    engine = make_engine(sampler="oracle", num_draft_tokens=3)
    sched = engine.scheduler
    post, release, seen = sched.postprocess, sched.cache.release, []

    def counted(plan, sampled, step=0, accepted=None):
        # each request that ran drafts and sampled: its token count once it takes every accepted token
        full = {req: req.num_tokens + 1 + len((accepted or {}).get(req.request_id, [])) for req, _ in plan
                if req.draft_ids and req.request_id in sampled}

        def released(req, cache):  # a request finishing in this step: its count as it enters the cache
            if req in full:
                seen.append((req.num_cached, req.num_tokens - 1, req.num_tokens < full[req]))
            release(req, cache)

        sched.cache.release = released
        try:
            finished = post(plan, sampled, step, accepted)
        finally:
            sched.cache.release = release
        seen.extend((req.num_cached, req.num_tokens - 1, False) for req in full if req not in finished)
        return finished

    sched.postprocess = counted
    for i, prompt in enumerate(random_prompts(seed=11, num=6, min_len=4, max_len=30)):
        engine.add_request(prompt, 5 + 3 * i)
    while engine.has_unfinished:
        engine.step()
        engine.check_integrity()
    assert [(cached, last) for cached, last, _ in seen if cached != last] == []
    assert len(seen) > 20 and any(cut for _, _, cut in seen)  # a request finishing partway through its drafts
