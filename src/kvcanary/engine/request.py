"""A request: its tokens, its status and where its K/V lives.

| field             | meaning                                                               |
|-------------------|-----------------------------------------------------------------------|
| row               | its page-table row in ``req_to_token`` (0 = none)                     |
| slots             | int64[capacity] (CPU): slot of each position ``[0, capacity)``; the   |
|                   | engine's own record, mirrored into ``req_to_token[row, :capacity]``   |
| num_cached        | positions ``[0, num_cached)`` hold computed K/V                        |
| num_prefix_cached | positions ``[0, num_prefix_cached)`` are shared prefix-cache slots    |
| prefix_node       | the prefix-cache node it locks (its matched prefix ends there)        |
| draft_ids         | speculative drafts of the current decode step (written after its      |
|                   | last token, at positions ``num_tokens ..``; cleared after the step)    |

Slots at positions ``[num_prefix_cached, capacity)`` are owned by the request alone. The
engine frees from ``slots``, never from the page table, so a damaged table cannot corrupt the
allocator.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from kvcanary.engine.radix import RadixNode
    from kvcanary.engine.sampler import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # retracted: holds nothing, waits to re-prefill its whole history
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"  # read damaged K/V under the raise policy: ended with an error (``Engine.fail``)


@dataclass(eq=False)
class Request:
    request_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)
    output_steps: list[int] = field(default_factory=list)  # engine step that sampled each output
    status: RequestStatus = RequestStatus.WAITING
    row: int = 0
    slots: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    num_cached: int = 0
    num_prefix_cached: int = 0
    prefix_node: RadixNode | None = None
    draft_ids: list[int] = field(default_factory=list)
    truth_len: int = 0  # positions of its history its row holds in the canary's truth table (appends)
    sampling: SamplingParams | None = None  # None: greedy (``Engine.add_request`` sets the seed)
    # ``prompt_ids`` as a read-only int64 array, made once: a prefill's ids are slices of it, not lists
    # converted again at every step
    prompt_array: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        self.prompt_array = np.array(self.prompt_ids, dtype=np.int64)
        self.prompt_array.flags.writeable = False

    @property
    def token_ids(self) -> list[int]:
        """Prompt + outputs so far: the token history whose K/V the request needs."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def capacity(self) -> int:
        return self.slots.numel()

    @property
    def num_uncached(self) -> int:
        return self.num_tokens - self.num_cached

    @property
    def is_done(self) -> bool:
        return len(self.output_ids) >= self.max_new_tokens

    @property
    def is_active(self) -> bool:
        """Holds a row (and possibly slots and a prefix lock)."""
        return self.row != 0

    def drop_outputs_since(self, step: int) -> int:
        """Forget outputs sampled at ``step`` or later (they may have read corrupted K/V); returns
        how many were dropped. Only for a request that holds no cache state."""
        keep = sum(1 for s in self.output_steps if s < step)
        dropped = len(self.output_ids) - keep
        del self.output_ids[keep:], self.output_steps[keep:]
        return dropped

    def reset_cache_state(self) -> None:
        """Forget every slot and lock; the caller has released them."""
        self.row = self.num_cached = self.num_prefix_cached = self.truth_len = 0
        self.slots = torch.zeros(0, dtype=torch.int64)
        self.prefix_node = None
        self.draft_ids = []
