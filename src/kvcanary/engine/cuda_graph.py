"""Graph-captured decode: the device half of a decode step in one CUDA graph per batch size.

What a graph holds, in order: jitter point 0, ``hooks.forward_prologue`` (the canary's HEAD),
jitter 1, the model (K/V writes, paged attention over a fixed ``max_ctx`` key window, logits),
jitter 2, ``hooks.forward_epilogue`` (the canary's TAIL), jitter 3. What stays outside, every
step: scheduling, ``hooks.before_forward`` (sweeps, the canary's token-truth scatter, faults),
``hooks.after_forward`` (the step report, policies) and sampling.

A batch size is captured right after its first eager decode step (so every kernel is compiled
and every library handle exists); later decode steps of that size copy their tensors into the
graph's fixed buffers and replay it. ``req_to_token``, the pools and the canary's buffers are the
engine's own persistent tensors, read in place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcanary.runtime.batch import ForwardBatch

# the per-step tensors of a ForwardBatch a graph reads from fixed buffers
STATIC_FIELDS = ("req_pool_indices", "prefix_lens", "extend_lens", "input_ids", "positions", "out_cache_loc")


@dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch  # the fixed buffers the graph reads
    logits: torch.Tensor  # the buffer the graph writes


class DecodeGraphs:
    def __init__(self, batch_sizes: tuple[int, ...]):
        self.batch_sizes = frozenset(batch_sizes)
        self.captured: dict[int, CapturedStep] = {}
        self.mempool = None
        self.replays = 0

    def eligible(self, batch: ForwardBatch) -> bool:
        """A decode-only batch (one token per request) of a captured or capturable size."""
        return batch.batch_size in self.batch_sizes and batch.num_tokens == batch.batch_size

    def load(self, batch: ForwardBatch) -> ForwardBatch | None:
        """Copy ``batch`` into its size's buffers and return the batch to run (its host-side fields
        are ``batch``'s), or None when that size is not captured yet."""
        step = self.captured.get(batch.batch_size) if self.eligible(batch) else None
        if step is None:
            return None
        for name in STATIC_FIELDS:
            getattr(step.batch, name).copy_(getattr(batch, name), non_blocking=True)
        return dataclasses.replace(step.batch, truth_ids=batch.truth_ids, truth_offsets=batch.truth_offsets,
                                   request_ids=batch.request_ids, slot_lut=batch.slot_lut)

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        step = self.captured[batch.batch_size]
        step.graph.replay()
        self.replays += 1
        return step.logits

    def capture(self, batch: ForwardBatch, device_step: Callable[[ForwardBatch], torch.Tensor]) -> None:
        """Capture ``device_step`` on fixed copies of ``batch``'s tensors (nothing runs now)."""
        static = dataclasses.replace(batch, **{name: getattr(batch, name).clone() for name in STATIC_FIELDS})
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, pool=self.mempool):
            logits = device_step(static)
        self.mempool = graph.pool()
        self.captured[batch.batch_size] = CapturedStep(graph, static, logits)
