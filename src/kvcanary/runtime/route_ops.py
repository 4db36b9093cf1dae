"""The plain route: HEAD and TAIL as the ops one by one (``CanaryConfig.fused=False``, or no
kernel serves): build the plan, verify the prefix, check the write targets, stamp, mark; TAIL
verifies the plan again with fingerprints, checks the writes landed, fingerprints them."""

from __future__ import annotations

import torch

from kvcanary.ops.conflicts import check_writes
from kvcanary.ops.fingerprint import fingerprint
from kvcanary.ops.gather import gather_expected_tokens
from kvcanary.ops.landed import check_writes_landed, mark_writes
from kvcanary.ops.plan import Plan, build_plan
from kvcanary.ops.stamp import stamp
from kvcanary.ops.verify import verify
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.forward import Forward


class OpsRoute(Forward):
    """HEAD and TAIL through the ops (see the module doc); ``plan``: the forward's plan, which
    TAIL verifies again. On CUDA the truth scatter is a launch of its own, made with HEAD."""

    def __init__(self, ctx, truth, truth_lens, holds):
        super().__init__(ctx, truth, truth_lens, holds)
        self.truth_with_head = self.on_cuda
        self.plan = Plan.allocate(ctx.config.plan_capacity, ctx.config.max_bs, ctx.state.device)

    def _head(self, b: ForwardBatch, tag: int) -> None:
        bs = b.batch_size
        given = self.scatter_for is b
        if self.scatter_for is not None:
            self.scatter_pending()
        truth = self.truth if self.use_truth(b) else None
        if truth is not None and b.truth_starts is not None and not given and self.truth_with_head:
            self.join()  # appends ``prepare_head`` left to HEAD, on the current stream ahead of its checks
            self.scatter_device(b)
        lut, state = self.lut(b), self.state
        truth_lens = self.truth_lens[:bs] if truth is not None else None
        build_plan(req_pool_indices=b.req_pool_indices, prefix_lens=b.prefix_lens, extend_lens=b.extend_lens,
                   req_to_token=b.req_to_token, plan=self.plan, truth=truth, truth_lens=truth_lens, lut=lut,
                   window=self.window)
        verify(state=state, plan=self.plan, tag=tag)
        woff = self.plan.write_offsets[: bs + 1]
        check_writes(state=state, plan=self.plan, out_cache_loc=b.out_cache_loc, input_ids=b.input_ids,
                     positions=b.positions, req_pool_indices=b.req_pool_indices, write_offsets=woff, tag=tag,
                     lut=lut, held=self.holds.held, marks=self.marks)
        self.holds.held = None
        expected = None
        if truth is not None:
            expected = gather_expected_tokens(truth=truth, truth_lens=truth_lens, req_pool_indices=b.req_pool_indices,
                                              prefix_lens=b.prefix_lens, extend_offsets=woff, input_ids=b.input_ids)
        stamp(state=state, out_cache_loc=b.out_cache_loc, input_ids=b.input_ids, positions=b.positions,
              req_pool_indices=b.req_pool_indices, prefix_lens=b.prefix_lens, write_offsets=woff,
              seed=self.plan.seed[:bs], tag=tag, expected_tokens=expected, lut=lut)
        mark_writes(state=state, out_cache_loc=b.out_cache_loc, sources=self.sources, lut=lut)

    def _tail(self, b: ForwardBatch, tag: int) -> None:
        verify(state=self.state, plan=self.plan, tag=tag, sources=self.kv)
        if self.sources:  # a write target still marked gets no fingerprint (ops.landed)
            landed = check_writes_landed(state=self.state, out_cache_loc=b.out_cache_loc, input_ids=b.input_ids,
                                         positions=b.positions, sources=self.sources, tag=tag, lut=self.lut(b))
            written = self.written(b)
            fingerprint(slots=torch.where(landed, written, torch.zeros_like(written)), sources=self.kv,
                        mode=self.kv.mode, state=self.state, record=True)

    def _warm_sizes(self) -> list[int]:
        """The ops specialise their segment search on the batch size's bit length: one size each."""
        sizes, bs = [], 1
        while bs <= self.config.max_bs:
            sizes.append(bs)
            bs *= 2
        return sizes
