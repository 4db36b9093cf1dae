"""Per-request sampling in the reference engine: temperature 0 is greedy, a seed reproduces a
sampled run in any batch and a recompute redraws the same tokens, ``top_k``/``top_p`` keep the
tokens an OpenAI-compatible server keeps (checked against a short pure-Python reference on fresh
random logits), and bad parameters are refused naming the field."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvcanary.config import CanaryConfig, Policy
from kvcanary.core.record import Half
from kvcanary.engine.canary_hooks import attach_canary
from kvcanary.engine.config import SamplerKind
from kvcanary.engine.sampler import SamplingParams, draw, uniform
from kvcanary.faults.base import flip_bit

from ._helpers import make_engine, random_prompts

PROMPTS = random_prompts(41, 4, min_len=10, max_len=24)
MAX_NEW = 16


def _reference_draw(logits: list[float], temperature: float, top_k: int, top_p: float, u: float) -> int:
    """The same draw, written plainly: softmax, most likely first (ties by id), top-k, top-p, inverse CDF."""
    scaled = [x / temperature for x in logits]
    m = max(scaled)
    weights = [math.exp(x - m) for x in scaled]
    total = sum(weights)
    order = sorted(range(len(logits)), key=lambda i: (-weights[i], i))
    probs = [weights[i] / total for i in order]
    if 0 < top_k < len(order):
        order, probs = order[:top_k], probs[:top_k]
    if top_p < 1:
        kept, ahead = 0, 0.0
        mass = sum(probs)
        for p in probs:
            if ahead >= top_p * mass:
                break
            kept, ahead = kept + 1, ahead + p
        order, probs = order[: max(kept, 1)], probs[: max(kept, 1)]
    target, acc = u * sum(probs), 0.0
    for i, p in zip(order, probs, strict=True):
        acc += p
        if acc > target:
            return i
    return order[-1]


def test_draw_matches_the_reference_on_random_logits():
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    for _ in range(300):
        vocab = rng.randint(2, 40)
        logits = torch.randn(vocab, generator=gen, dtype=torch.float64) * rng.choice([0.5, 2.0, 6.0])
        params = SamplingParams(temperature=rng.choice([0.3, 0.7, 1.0, 1.8]), top_k=rng.choice([0, 1, 3, 10]),
                                top_p=rng.choice([1.0, 0.9, 0.5, 0.05]), seed=rng.getrandbits(64))
        u = uniform(params.seed, rng.randint(0, 500))
        want = _reference_draw(logits.tolist(), params.temperature, params.top_k, params.top_p, u)
        assert draw(logits, params, u) == want


def test_draw_frequencies_follow_the_kept_probabilities():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0], dtype=torch.float64)
    params = SamplingParams(temperature=1.0, top_k=3)
    probs = torch.softmax(logits[:3], -1).tolist()
    n = 10_000
    counts = [0] * 5
    for i in range(n):
        counts[draw(logits, params, (i + 0.5) / n)] += 1
    assert counts[3:] == [0, 0]
    assert all(abs(c - p * n) <= 1 for c, p in zip(counts, probs, strict=False))
    top_p = SamplingParams(temperature=1.0, top_p=0.5)  # the first token alone holds more than half
    assert {draw(logits, top_p, (i + 0.5) / 100) for i in range(100)} == {0}


def _run(prompts, sampling, **overrides):
    engine = make_engine(**overrides)
    ids = [engine.add_request(p, MAX_NEW, sampling=s) for p, s in zip(prompts, sampling, strict=True)]
    engine.run_until_done()
    return [engine.output_ids(i) for i in ids]


def test_temperature_zero_and_top_k_one_are_greedy():
    greedy = _run(PROMPTS, [None] * 4)
    assert _run(PROMPTS, [SamplingParams(temperature=0.0, seed=3)] * 4) == greedy
    assert _run(PROMPTS, [SamplingParams(temperature=1.5, top_k=1, seed=3)] * 4) == greedy
    assert _run(PROMPTS, [SamplingParams(temperature=1.0, top_p=1e-9, seed=3)] * 4) == greedy
    assert _run(PROMPTS, [SamplingParams(temperature=1.0, seed=3)] * 4) != greedy


def test_a_seed_reproduces_a_sampled_run_in_any_batch_and_another_seed_differs():
    seeded = [SamplingParams(temperature=1.0, top_p=0.95, seed=1000 + i) for i in range(4)]
    together = _run(PROMPTS, seeded)
    alone = [_run([p], [s])[0] for p, s in zip(PROMPTS, seeded, strict=True)]
    assert together == alone
    assert _run(PROMPTS, seeded, chunk_size=8) == together  # other chunking, other batches
    other = _run(PROMPTS, [SamplingParams(temperature=1.0, top_p=0.95, seed=2000 + i) for i in range(4)])
    assert all(a != b for a, b in zip(other, together, strict=True))
    unseeded = SamplingParams(temperature=1.0)
    engine = make_engine()
    a, b = engine.add_request(PROMPTS[0], 4, sampling=unseeded), engine.add_request(PROMPTS[0], 4, sampling=unseeded)
    seeds = {engine.requests[a].sampling.seed, engine.requests[b].sampling.seed}
    assert len(seeds) == 2 and None not in seeds  # each its own random seed, kept with the request


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_recompute_redraws_the_fault_free_tokens_of_a_seeded_request(device):
    seeded = [SamplingParams(temperature=1.0, top_k=50, seed=70 + i) for i in range(4)]
    want = _run(PROMPTS, seeded, enable_prefix_cache=False, device=device)
    engine, hooks = attach_canary(lambda h: make_engine(h, enable_prefix_cache=False, device=device),
                                  CanaryConfig(policy=Policy.RECOMPUTE))
    ids = [engine.add_request(p, MAX_NEW, sampling=s) for p, s in zip(PROMPTS, seeded, strict=True)]
    while min(len(engine.requests[i].output_ids) for i in ids) < 4:
        engine.step()
    flip_bit(engine, 0, Half.K, int(engine.requests[ids[2]].slots[3]), 0, 1)
    engine.run_until_done()
    assert engine.stats.num_recomputes >= 1 and hooks.canary.totals.violations >= 1
    assert [engine.output_ids(i) for i in ids] == want


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"temperature": -0.1}, "SamplingParams.temperature must be a finite number >= 0, got -0.1"),
    ({"temperature": float("nan")}, "SamplingParams.temperature must be a finite number >= 0, got nan"),
    ({"top_p": 0.0}, r"SamplingParams.top_p must be a number in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, r"SamplingParams.top_p must be a number in \(0, 1\], got 1.5"),
    ({"top_k": -1}, r"SamplingParams.top_k must be an int >= 0 \(0: every token\), got -1"),
    ({"top_k": 2.0}, r"SamplingParams.top_k must be an int >= 0 \(0: every token\), got 2.0"),
    ({"seed": -1}, r"SamplingParams.seed must be None or an int in \[0, 2\^64\), got -1"),
    ({"seed": 1 << 64}, r"SamplingParams.seed must be None or an int in \[0, 2\^64\)"),
])
def test_bad_sampling_params_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_the_oracle_sampler_refuses_sampling():
    engine = make_engine(sampler=SamplerKind.ORACLE)
    with pytest.raises(ValueError, match="needs EngineConfig.sampler 'greedy'"):
        engine.add_request(PROMPTS[0], 4, sampling=SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="sampling must be a SamplingParams or None, got dict"):
        engine.add_request(PROMPTS[0], 4, sampling={"temperature": 1.0})
