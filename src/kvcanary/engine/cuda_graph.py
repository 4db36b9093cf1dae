"""Graph-captured decode: the device half of a decode step in one CUDA graph per batch size.

What a graph holds, in order: jitter point 0, ``hooks.forward_prologue`` (the canary's HEAD),
jitter 1, the model (K/V writes, paged attention over a fixed ``max_ctx`` key window, logits),
jitter 2, ``hooks.forward_epilogue`` (the canary's TAIL), jitter 3. What stays outside, every
step: scheduling, ``hooks.before_forward`` (sweeps, faults, and the canary's token-truth scatter
unless the batch hands its truth as appends: then the graph appends it, from fixed buffers),
``hooks.after_forward`` (the step report, policies) and sampling.

A batch size is captured at its first decode step, before that step runs: the step is the
graph's first replay, as every later decode step of that size is (its tensors copied into the
graph's fixed buffers). No step of a captured size runs eagerly, as in an engine that captures
every size at startup. Every kernel and library handle a capture records exists by then: a
decode step follows the prefill of each of its requests, which ran eagerly (the same model
kernels), and a canary compiles its kernels when it is built. ``req_to_token``, the pools and
the canary's buffers are the engine's own persistent tensors, read in place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcanary.engine.forward_batch import counting
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.capture import collection_paused

# the per-step tensors of a ForwardBatch a graph reads from fixed buffers
STATIC_FIELDS = ("req_pool_indices", "prefix_lens", "extend_lens", "input_ids", "positions", "out_cache_loc")
# ... and, where decode batches hand their truth as appends (one token a request), its token ids:
# the appends' starts are the batch's prefix lengths (in the graph, the same fixed buffer) and
# their offsets 0..bs (the tensor ``forward_batch.counting`` keeps for the size, never written)
TRUTH_FIELDS = ("truth_ids",)


@dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch  # the fixed buffers the graph reads
    logits: torch.Tensor  # the buffer the graph writes


class DecodeGraphs:
    def __init__(self, batch_sizes: tuple[int, ...], appends: bool = False):
        self.batch_sizes = frozenset(batch_sizes)
        self.captured: dict[int, CapturedStep] = {}
        self.mempool = None
        self.replays = 0
        self.appends = appends  # decode batches hand their truth as appends: the graph reads it too
        self.fields = STATIC_FIELDS + TRUTH_FIELDS if appends else STATIC_FIELDS

    def eligible(self, batch: ForwardBatch) -> bool:
        """A decode-only batch (one token per request) of a captured or capturable size; with
        ``appends``, one whose truth is one token a request appended where its prefix ends: its
        starts are its prefix lengths' tensor and its offsets the kept 0..bs (a batch with a row
        to fill runs eagerly)."""
        return (batch.batch_size in self.batch_sizes and batch.num_tokens == batch.batch_size
                and (not self.appends or (batch.truth_starts is batch.prefix_lens
                                          and batch.truth_offsets is counting(batch.batch_size + 1,
                                                                              batch.truth_offsets.device))))

    def load(self, batch: ForwardBatch, device_step: Callable[[ForwardBatch], torch.Tensor]) -> ForwardBatch | None:
        """Copy ``batch`` into its size's buffers and return the batch to replay (its host-side
        fields are ``batch``'s), capturing ``device_step`` for that size first if it is not
        captured yet; None for a batch that runs eagerly (not ``eligible``)."""
        if not self.eligible(batch):
            return None
        step = self.captured.get(batch.batch_size)
        if step is None:
            step = self.capture(batch, device_step)
        for name in self.fields:
            getattr(step.batch, name).copy_(getattr(batch, name), non_blocking=True)
        if self.appends:
            return dataclasses.replace(step.batch, request_ids=batch.request_ids, slot_lut=batch.slot_lut)
        return dataclasses.replace(step.batch, truth_ids=batch.truth_ids, truth_offsets=batch.truth_offsets,
                                   request_ids=batch.request_ids, slot_lut=batch.slot_lut)

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        step = self.captured[batch.batch_size]
        step.graph.replay()
        self.replays += 1
        return step.logits

    def fixed_buffers(self, batch: ForwardBatch) -> ForwardBatch:
        """The batch a graph of ``batch``'s size is captured on: fixed copies of the tensors
        ``load`` refills (with ``appends``, the starts are the prefix lengths' buffer, the
        offsets the kept 0..bs)."""
        static = dataclasses.replace(batch, **{name: getattr(batch, name).clone() for name in self.fields})
        if self.appends:  # the appends start where the prefix ends: the graph reads one buffer for both
            static = dataclasses.replace(static, truth_starts=static.prefix_lens)
        return static

    def capture(self, batch: ForwardBatch, device_step: Callable[[ForwardBatch], torch.Tensor]) -> CapturedStep:
        """Capture ``device_step`` on fixed copies of ``batch``'s tensors (nothing runs now)."""
        static = self.fixed_buffers(batch)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with collection_paused(), torch.cuda.graph(graph, pool=self.mempool):
            logits = device_step(static)
        self.mempool = graph.pool()
        step = self.captured[batch.batch_size] = CapturedStep(graph, static, logits)
        return step
