"""The built-in workload and its driver: deterministic, and it reaches every path the canary guards."""

from __future__ import annotations

import json

import pytest

from kvcanary.engine.config import ModelConfig
from kvcanary.engine.engine import Engine
from kvcanary.engine.request import RequestStatus
from kvcanary.engine.workload import CHUNK_SIZE, WorkloadConfig, builtin_workload, engine_config_for, load_prompts
from kvcanary.errors import ConfigError
from kvcanary.runs.driver import run_workload


def test_builtin_workload_is_seeded():
    a, b = builtin_workload(WorkloadConfig(seed=3)), builtin_workload(WorkloadConfig(seed=3))
    assert a == b and a != builtin_workload(WorkloadConfig(seed=4))


def test_builtin_workload_shape():
    c = WorkloadConfig(num_requests=40)
    w = builtin_workload(c)
    assert w.num_requests == 40 and [r.arrival_step for r in w.requests] == list(range(40))
    heads = {r.prompt_ids[: c.system_prompt_len] for r in w.requests}
    assert len(heads) == c.num_system_prompts
    assert sum(len(r.prompt_ids) > 2 * CHUNK_SIZE for r in w.requests) == 40 // c.long_every
    aborted = [i for i, r in enumerate(w.requests) if r.abort_after]
    assert aborted == list(range(c.abort_every - 1, 40, c.abort_every))
    assert all(0 < w.requests[i].abort_after < c.max_new_tokens for i in aborted)
    assert all(0 <= t < c.vocab_size for r in w.requests for t in r.prompt_ids)


def test_driver_exercises_cache_offload_load_back_chunks_and_aborts():
    w = builtin_workload(WorkloadConfig(num_requests=40))
    engine = Engine(ModelConfig(), engine_config_for(w))
    seen = []
    counts = run_workload(engine, w, progress=lambda done, total: seen.append((done, total)))
    engine.check_integrity()
    s = engine.stats
    assert s.num_prefix_hit_tokens > 0 and s.num_evicted_slots > 0 and s.num_offloaded_slots > 0
    assert s.num_loaded_slots > 0, "a system prompt must come back from the host tier"
    assert s.num_aborts == counts.aborted == sum(1 for r in w.requests if r.abort_after) > 0
    assert counts.requests == 40 and counts.finished + counts.aborted == 40
    assert counts.steps == s.num_steps and counts.step_seconds > 0
    assert counts.generated_tokens == sum(r.abort_after or r.max_new_tokens for r in w.requests)
    assert seen[-1] == (40, 40) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    for rid, req in zip(counts.request_ids, w.requests, strict=True):
        status = engine.requests[rid].status
        assert status is (RequestStatus.ABORTED if req.abort_after else RequestStatus.FINISHED)


def test_aborts_happen_mid_generation():
    w = builtin_workload(WorkloadConfig(num_requests=10, abort_every=2))
    engine = Engine(ModelConfig(), engine_config_for(w))
    counts = run_workload(engine, w)
    for rid, req in zip(counts.request_ids, w.requests, strict=True):
        if req.abort_after:
            assert len(engine.output_ids(rid)) == req.abort_after < req.max_new_tokens


def test_load_prompts_round_trip(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt_ids": [1, 2, 3], "max_new_tokens": 4}\n\n{"prompt_ids": [5], "max_new_tokens": 2}\n')
    w = load_prompts(path, vocab_size=256, arrivals_per_step=2)
    assert [(r.prompt_ids, r.max_new_tokens, r.arrival_step) for r in w.requests] == [((1, 2, 3), 4, 0),
                                                                                       ((5,), 2, 0)]
    engine = Engine(ModelConfig(), engine_config_for(w))
    assert run_workload(engine, w).generated_tokens == 6


@pytest.mark.parametrize("line, message", [
    ("not json", "not JSON"),
    ('{"prompt_ids": [], "max_new_tokens": 1}', "prompt_ids must be"),
    ('{"prompt_ids": [300], "max_new_tokens": 1}', "prompt_ids must be"),
    ('{"prompt_ids": [1], "max_new_tokens": 0}', "max_new_tokens must be"),
    ('[1, 2]', "prompt_ids must be"),
])
def test_load_prompts_names_the_bad_line(tmp_path, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt_ids": [1], "max_new_tokens": 1}) + "\n" + line + "\n")
    with pytest.raises(ConfigError, match=f"p.jsonl:2: {message}"):
        load_prompts(path, vocab_size=256)


def test_workload_config_is_validated():
    with pytest.raises(ConfigError, match="num_requests"):
        WorkloadConfig(num_requests=0)
    with pytest.raises(ConfigError, match="user_len"):
        WorkloadConfig(user_len=(5, 2))
