"""Next-token choice: greedy (argmax) or the deterministic oracle.

The oracle's token is a hash of (request id, position) and ignores the logits, so a run's
outputs are known in advance whatever happens to the KV cache: the truth for token checks.
Speculative decoding drafts with ``draft_tokens`` (right three times in four) and keeps the
drafts the oracle agrees with (``Sampler.accept_drafts``).
"""

from __future__ import annotations

from collections.abc import Sequence

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


class Sampler:
    def __init__(self, kind: SamplerKind, vocab_size: int):
        self.kind, self.vocab_size = kind, vocab_size

    def sample(self, logits: torch.Tensor, request_ids: Sequence[int], positions: Sequence[int]) -> list[int]:
        """One token per row of ``logits`` ([n, vocab]); ``positions[i]`` is where it will sit."""
        if self.kind is SamplerKind.GREEDY:
            return logits.argmax(-1).tolist()
        return [
            oracle_token(rid, pos, self.vocab_size) for rid, pos in zip(request_ids, positions, strict=True)
        ]

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
