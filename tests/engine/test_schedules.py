"""Random schedules through the correct engine with the canary on: arrivals that share prefixes,
aborts, forced evictions (offloads when there is a host tier), preemption under small pools,
chunked prefill, speculative drafts and batch padding. Every schedule must keep the host
invariants after every step and leave the canary silent."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvcanary.config import CanaryConfig, Policy
from kvcanary.engine import Engine, EngineConfig, ModelConfig, RequestStatus, SamplerKind
from kvcanary.engine.canary_hooks import attach_canary
from kvcanary.engine.sampler import oracle_token
from kvcanary.ops.fingerprint import FingerprintMode

MAX_CTX = 64
SYSTEM_PROMPTS = [[(7 * i + 3 * j) % 251 + 1 for j in range(n)] for i, n in enumerate((5, 9, 16))]


@st.composite
def engine_configs(draw) -> EngineConfig:
    page_size = draw(st.sampled_from([1, 2, 4]))
    num_pages = draw(st.integers(MAX_CTX // page_size + 2, 4 * MAX_CTX // page_size))
    prefix_cache = draw(st.booleans())
    oracle = draw(st.booleans())
    return EngineConfig(
        num_slots=num_pages * page_size, page_size=page_size, max_rows=9, max_ctx=MAX_CTX,
        chunk_size=draw(st.sampled_from([3, 8, 16])), max_tokens_per_step=draw(st.sampled_from([8, 24, 64])),
        max_running=draw(st.integers(1, 6)), enable_prefix_cache=prefix_cache,
        host_tier_slots=draw(st.sampled_from([0, 64, 256])) if prefix_cache else 0,
        sampler=SamplerKind.ORACLE if oracle else SamplerKind.GREEDY,
        num_draft_tokens=draw(st.sampled_from([0, 2, 3])) if oracle else 0,
        graph_batch_sizes=draw(st.sampled_from([(), (1, 2, 4, 8)])))


# ("add", system prompt (len(SYSTEM_PROMPTS): none), user part length, user part seed, max_new_tokens)
arrival = st.tuples(st.just("add"), st.integers(0, len(SYSTEM_PROMPTS)), st.integers(1, 44), st.integers(0, 255),
                    st.integers(1, 10))
other = st.one_of(st.tuples(st.just("abort"), st.integers(0, 50)), st.tuples(st.just("evict"), st.integers(1, 64)))
# rounds of arrivals, then steps, then at most one abort or forced eviction: requests that share a
# system prompt arrive after earlier ones finished (prefix hits), while others still run (pressure)
rounds = st.lists(st.tuples(st.lists(arrival, max_size=4), st.integers(0, 8), st.lists(other, max_size=1)),
                  min_size=2, max_size=10)
actions = rounds.map(lambda rs: [a for adds, n, rest in rs for a in (*adds, ("step", n), *rest)])


def _run(config: EngineConfig, schedule: list, sweep_interval: int) -> None:
    canary = CanaryConfig(policy=Policy.LOG, real_kv=FingerprintMode.ALL, sweep_interval=sweep_interval)
    engine, hooks = attach_canary(lambda h: Engine(ModelConfig(), config, h), canary)
    ids: list[int] = []

    def step() -> None:
        if engine.has_unfinished:
            engine.step()
            engine.check_integrity()

    for action in schedule:
        if action[0] == "add":
            _, system, user_len, seed, max_new = action
            user = [(seed + 37 * j) % 255 + 1 for j in range(user_len)]
            prompt = (SYSTEM_PROMPTS[system] if system < len(SYSTEM_PROMPTS) else []) + user
            ids.append(engine.add_request(prompt[: MAX_CTX - max_new], max_new))
        elif action[0] == "step":
            for _ in range(action[1]):
                step()
        elif action[0] == "abort" and ids:
            engine.abort(ids[action[1] % len(ids)])
            engine.check_integrity()
        elif action[0] == "evict":
            engine.cache.evict(action[1])
            engine.check_integrity()
    while engine.has_unfinished:
        step()
    hooks.canary.flush(engine.step_index)
    assert hooks.canary.totals.violations == 0 and not hooks.reports, [v.line() for r in hooks.reports
                                                                        for v in r.violations][:4]
    assert hooks.canary.totals.forwards == engine.stats.num_steps
    for rid in ids:
        req = engine.requests[rid]
        assert req.status in (RequestStatus.FINISHED, RequestStatus.ABORTED) and not req.is_active
        assert req.status is RequestStatus.ABORTED or len(req.output_ids) == req.max_new_tokens
        if config.sampler is SamplerKind.ORACLE:  # the outputs are known whatever the schedule did
            start = len(req.prompt_ids)
            assert req.output_ids == [oracle_token(rid, start + i, 256) for i in range(len(req.output_ids))]


@given(config=engine_configs(), schedule=actions, sweep_interval=st.integers(1, 3))
def test_random_schedules_keep_invariants_and_the_canary_silent(config, schedule, sweep_interval):
    _run(config, schedule, sweep_interval)


@given(schedule=actions)
def test_tight_pool_with_host_tier_preempts_offloads_and_loads_back_cleanly(schedule):
    """A pool of three contexts with a host tier: eviction, offload, load-back and preemption on
    almost every step."""
    config = EngineConfig(num_slots=3 * MAX_CTX, max_rows=9, max_ctx=MAX_CTX, chunk_size=8, max_tokens_per_step=32,
                          max_running=6, host_tier_slots=2 * MAX_CTX)
    _run(config, [("add", i % 4, 30, i, 10) for i in range(6)] + schedule, sweep_interval=1)
