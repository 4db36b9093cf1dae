"""Graph-captured decode: the capturable forward (fixed key width) gives the same logits as the
eager one, the configuration is checked, and on a GPU whole runs with graphs (and with timing
jitter) match eager runs token for token with the canary silent, and still catch a fault."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from kvcanary.config import CanaryConfig
from kvcanary.engine.config import EngineConfig, ModelConfig
from kvcanary.engine.workload import WorkloadConfig, builtin_workload, engine_config_for
from kvcanary.errors import ConfigError
from kvcanary.faults.judge import judge, select_faults
from kvcanary.runs.setup import RunSetup
from kvcanary.runs.single import run_once

from ._helpers import RecordingHooks, make_engine, random_prompts

GRAPH_SIZES = (1, 2, 4, 8, 16, 32)


def test_fixed_key_width_gives_the_same_logits():
    """The decode forward with keys over all of max_ctx (what a graph captures) == the eager one."""
    hooks = RecordingHooks()
    engine = make_engine(hooks=hooks, graph_batch_sizes=(1, 2, 4, 8))
    engine.generate(random_prompts(seed=3, num=5, prefix_len=7), 5)
    decodes = [args[0] for name, args in hooks.events if name == "before_forward"
               and args[0].num_tokens == args[0].batch_size]
    assert decodes, "the run had no decode step"
    batch = decodes[-1]
    eager = engine.model.forward(batch, engine.pool)  # rewrites the same K/V: idempotent
    fixed = engine.model.forward(batch, engine.pool, max_len=engine.config.max_ctx)
    assert torch.equal(eager, fixed)


@pytest.mark.parametrize(("overrides", "fragment"), [
    (dict(cuda_graph=True, graph_batch_sizes=(1, 2)), "cuda_graph must be False unless device is CUDA"),
    (dict(cuda_graph=True, device="cuda"), "cuda_graph must be False unless device is CUDA"),
    (dict(jitter_ns=-1), "jitter_ns must be an int >= 0"),
])
def test_config_errors(overrides, fragment):
    if overrides.get("device") == "cuda" and not torch.cuda.is_available():
        overrides = {k: v for k, v in overrides.items() if k != "device"}
    with pytest.raises(ConfigError) as info:
        EngineConfig(**overrides)
    assert fragment in str(info.value)


# --- on a GPU -----------------------------------------------------------------------------------

def _setup(cuda_graph: bool, jitter_ns: int = 0, num_requests: int = 40, truth_appends: bool | None = None) -> RunSetup:
    workload = builtin_workload(WorkloadConfig(num_requests=num_requests, seed=1))
    engine = dataclasses.replace(engine_config_for(workload, device="cuda"), graph_batch_sizes=GRAPH_SIZES,
                                 cuda_graph=cuda_graph, jitter_ns=jitter_ns, jitter_seed=5,
                                 truth_appends=truth_appends)
    return RunSetup(ModelConfig(seed=1), engine, CanaryConfig(sweep_interval=4), workload)


def _outputs(out) -> dict[int, list[int]]:
    return {rid: req.output_ids for rid, req in out.engine.requests.items()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("jitter_ns", [0, 20_000], ids=["graphs", "graphs+jitter"])
def test_graph_replay_matches_eager_and_stays_clean(jitter_ns):
    """Eager with whole token histories against graphs that append each decode's truth inside."""
    eager = run_once(_setup(cuda_graph=False, truth_appends=False))
    graphed = run_once(_setup(cuda_graph=True, jitter_ns=jitter_ns))
    assert graphed.engine.graphs.replays > 0 and len(graphed.engine.graphs.captured) > 1
    assert graphed.engine.graphs.appends and not eager.engine.config.appends_truth
    assert eager.violations == [] and graphed.violations == [] and graphed.alarms == []
    assert _outputs(graphed) == _outputs(eager)
    if jitter_ns:
        assert graphed.engine.jitter.draws == graphed.engine.stats.num_steps
    counters = graphed.hooks.canary.counters()
    assert counters["HEAD"]["launches"] == counters["TAIL"]["launches"] == graphed.engine.stats.num_steps


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["page_table_repoint", "used_slot_flip", "written_slot_flip", "sampled_token_swap"])
def test_faults_are_caught_inside_replayed_graphs(name):
    (fault,) = select_faults([name], seed=0, warmup_steps=30)
    out = run_once(_setup(cuda_graph=True), [fault])
    verdict = judge(fault, out.injections, out.violations)
    assert out.engine.graphs.replays > 0
    assert verdict.injected and verdict.detected, (verdict.expected, verdict.first_detection)
    assert verdict.false_positives == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_garbage_collection_runs_inside_a_capture():
    """With collections as often as the collector allows, none runs while a graph is captured
    (one there that frees another engine's graph invalidates the capture), and the engine built
    after another one's garbage captures and runs clean."""
    first = run_once(_setup(cuda_graph=True, num_requests=8))
    assert first.engine.graphs.captured
    del first  # its graphs in reference cycles: garbage for the collector
    inside = []
    watch = lambda phase, info: inside.append(phase) if torch.cuda.is_current_stream_capturing() else None  # noqa: E731
    threshold = gc.get_threshold()
    gc.callbacks.append(watch)
    gc.set_threshold(1, 1, 1)
    try:
        out = run_once(_setup(cuda_graph=True, num_requests=8))
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(watch)
    assert inside == [] and len(out.engine.graphs.captured) > 1 and out.engine.graphs.replays > 0
    assert out.violations == [] and out.error is None
