"""Next-token choice: greedy (argmax) or the deterministic oracle.

The oracle's token is a hash of (request id, position) and ignores the logits, so a run's
outputs are known in advance whatever happens to the KV cache: the truth for token checks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcanary.core.hashing import splitmix64
from kvcanary.engine.config import SamplerKind


def oracle_token(request_id: int, position: int, vocab_size: int) -> int:
    """The oracle's token at ``position`` (index in prompt + outputs) of request ``request_id``."""
    return splitmix64(splitmix64(request_id) ^ position) % vocab_size


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
