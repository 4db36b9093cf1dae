"""What the two-rank tests run inside each rank's process (importable by the spawned children)."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.engine.config import EngineConfig, ModelConfig, SamplerKind
from kvcanary.engine.engine import Engine
from kvcanary.engine.tp import build_rank_engine
from kvcanary.faults.base import Expectation, Fault
from kvcanary.runs.tp import init_rank, run_rank_job

LOGITS_MODEL = ModelConfig(num_heads=4, num_kv_heads=2, intermediate=96, seed=3)
LOGITS_ENGINE = EngineConfig(num_slots=512, max_rows=17, max_ctx=64, chunk_size=8, max_tokens_per_step=48,
                             max_running=8, sampler=SamplerKind.GREEDY)


def logits_prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(256) for _ in range(rng.randrange(3, 30))] for _ in range(8)]


def step_logits(engine: Engine) -> list[dict[int, torch.Tensor]]:
    """Every step's logits (request id -> [vocab]) of the prompts, 6 new tokens each, chunked prefill."""
    for p in logits_prompts():
        engine.add_request(p, 6)
    out = []
    while engine.has_unfinished:
        out.append({rid: x.cpu() for rid, x in engine.step().logits.items()})
    return out


class DivergingSampler:
    """Samples like ``inner``, except once: a token of a request with at least two more to go is
    changed on this rank only (ranks that disagree on a sampled token, e.g. a non-deterministic
    sampler per rank). The canary's checks on this rank stay consistent: only the digest sees it."""

    def __init__(self, inner, fault: SamplerDivergence):
        self.inner, self.fault = inner, fault

    def sample(self, logits, request_ids, positions, params=None):
        tokens = self.inner.sample(logits, request_ids, positions, params)
        engine, step = self.fault.engine, self.fault.engine.step_index
        ok = [i for i, rid in enumerate(request_ids)
              if engine.requests[rid].max_new_tokens - len(engine.requests[rid].output_ids) > 2]
        if ok and self.fault.is_armed(step):
            i = ok[0]
            new = (tokens[i] + 1) % engine.model_config.vocab_size
            self.fault.record(step, 0, f"request={request_ids[i]} sampled {new} instead of {tokens[i]} on this "
                                       "rank only", set())
            tokens[i] = new
        return tokens

    def accept_drafts(self, request_id, position, drafts):
        return self.inner.accept_drafts(request_id, position, drafts)


class SamplerDivergence(Fault):
    name = "sampler_divergence"
    expected = Expectation(LaunchPoint.HEAD, Reason(0))  # no slot check can see it: the chain digest does

    def attach(self, engine, canary=None):
        super().attach(engine, canary)
        engine.sampler = DivergingSampler(engine.sampler, self)


def main(rank: int, world: int, port: int, jobs, results, log_level: int, threads: int) -> None:
    """A rank of the tests: the TP engine's logits first (no canary), then every job."""
    torch.set_num_threads(threads)
    init_rank(rank, world, port, "cpu")
    try:
        engine = build_rank_engine(LOGITS_MODEL, LOGITS_ENGINE)
        results.put(("report", "logits", {"rank": rank, "logits": step_logits(engine),
                                          "kv_heads": engine.pool.k_buffers[0].shape[1]}))
        for job in jobs:
            results.put(("report", job.name, run_rank_job(job)))
    finally:
        dist.destroy_process_group()
