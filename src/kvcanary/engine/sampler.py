"""Next-token choice: greedy (argmax), sampled per request (``SamplingParams``), or the
deterministic oracle.

A sampled token is drawn by inverse CDF with one uniform number that is a function of the
request's seed and the token's position alone (``uniform``), never of a generator's state: a
request re-prefilled after a recovery, in whatever batch, redraws exactly the tokens it drew
before. The oracle's token is a hash of (request id, position) and ignores the logits, so a run's
outputs are known in advance whatever happens to the KV cache: the truth for token checks.
Speculative decoding drafts with ``draft_tokens`` (right three times in four) and keeps the
drafts the oracle agrees with (``Sampler.accept_drafts``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcanary.core.hashing import splitmix64
from kvcanary.engine.config import SamplerKind


def oracle_token(request_id: int, position: int, vocab_size: int) -> int:
    """The oracle's token at ``position`` (index in prompt + outputs) of request ``request_id``."""
    return splitmix64(splitmix64(request_id) ^ position) % vocab_size


def draft_tokens(request_id: int, position: int, num: int, vocab_size: int) -> list[int]:
    """``num`` drafts for positions ``position ..``: the oracle's token three times in four, else
    the next id."""
    out = []
    for p in range(position, position + num):
        token = oracle_token(request_id, p, vocab_size)
        is_wrong = splitmix64(splitmix64(request_id ^ 0xD4AF7) ^ p) % 4 == 0
        out.append((token + 1) % vocab_size if is_wrong else token)
    return out


_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens, as OpenAI-compatible servers take it.

    ``temperature`` 0: greedy (argmax; the rest is ignored). Otherwise the token is drawn from
    softmax(logits / temperature) kept to the ``top_k`` most likely tokens (0: all) and then to
    the smallest most-likely-first set whose probability reaches ``top_p``. ``seed`` (an int in
    [0, 2^64)) makes the draws reproducible: the draw at a position depends on (seed, position)
    only; ``Engine.add_request`` gives a request without one a random seed of its own."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        t, p, k, seed = self.temperature, self.top_p, self.top_k, self.seed
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"SamplingParams.top_p must be a number in (0, 1], got {p!r}")
        if type(k) is not int or k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0: every token), got {k!r}")
        if seed is not None and (type(seed) is not int or not 0 <= seed <= _MASK64):
            raise ValueError(f"SamplingParams.seed must be None or an int in [0, 2^64), got {seed!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def uniform(seed: int, position: int) -> float:
    """The draw for the token at ``position`` of a request seeded ``seed``: in [0, 1), 53 bits."""
    return (splitmix64(splitmix64(seed) ^ position) >> 11) * 2.0**-53


def draw(logits: torch.Tensor, params: SamplingParams, u: float) -> int:
    """The token ``params`` picks from ``logits`` ([vocab]) with the uniform number ``u``: the
    first token, most likely first (ties by id), whose cumulative kept probability exceeds ``u``."""
    scaled = logits.detach().to("cpu", torch.float64) / params.temperature
    probs, ids = torch.sort(torch.softmax(scaled, -1), descending=True, stable=True)
    if 0 < params.top_k < probs.numel():
        probs, ids = probs[: params.top_k], ids[: params.top_k]
    if params.top_p < 1:
        before = torch.cumsum(probs, 0) - probs  # probability of the tokens ahead of each
        keep = int((before < params.top_p * float(probs.sum())).sum())
        probs, ids = probs[: max(keep, 1)], ids[: max(keep, 1)]
    cdf = torch.cumsum(probs, 0)
    i = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True)[0])
    return int(ids[min(i, ids.numel() - 1)])


class Sampler:
    def __init__(self, kind: SamplerKind, vocab_size: int):
        self.kind, self.vocab_size = kind, vocab_size

    def sample(self, logits: torch.Tensor, request_ids: Sequence[int], positions: Sequence[int],
               params: Sequence[SamplingParams | None] | None = None) -> list[int]:
        """One token per row of ``logits`` ([n, vocab]); ``positions[i]`` is where it will sit;
        ``params[i]``: how row i samples (None, or ``params`` None: greedy). Seeds are set."""
        if self.kind is SamplerKind.ORACLE:
            return [oracle_token(rid, pos, self.vocab_size) for rid, pos in zip(request_ids, positions, strict=True)]
        tokens = logits.argmax(-1).tolist()
        if params is not None:
            for i, p in enumerate(params):
                if p is not None and not p.is_greedy:
                    tokens[i] = draw(logits[i], p, uniform(p.seed, positions[i]))
        return tokens

    def accept_drafts(self, request_id: int, position: int, drafts: Sequence[int]) -> list[int]:
        """Tokens after the one sampled for ``position``, one per leading draft the oracle agrees
        with (draft i stands at ``position + i``): [oracle(position + 1), ...]. Oracle only."""
        assert self.kind is SamplerKind.ORACLE, "drafts are verified against the oracle sampler"
        out = []
        for i, draft in enumerate(drafts):
            if draft != oracle_token(request_id, position + i, self.vocab_size):
                break
            out.append(oracle_token(request_id, position + i + 1, self.vocab_size))
        return out
