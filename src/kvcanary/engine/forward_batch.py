"""Build the ``ForwardBatch`` of one step from the scheduler's plan.

For request r with ``prefix_lens[r] = p`` and ``extend_lens[r] = n``, its tokens occupy
``input_ids[s : s + n]`` with ``s = sum(extend_lens[:r])``, at positions ``p .. p + n - 1``,
written to slots ``req_to_token[row_r, p .. p + n - 1]``.
"""

from __future__ import annotations

import itertools

import torch

from kvcanary.engine.scheduler import Plan
from kvcanary.runtime.batch import ForwardBatch


def build_forward_batch(plan: Plan, req_to_token: torch.Tensor) -> ForwardBatch:
    """The forward of ``plan`` (non-empty). Index tensors are int64 on ``req_to_token``'s device;
    ``req_to_token`` itself is passed through, not copied."""
    device = req_to_token.device
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64)
    rows = as_tensor([req.row for req, _ in plan])
    prefix_lens = as_tensor([req.num_cached for req, _ in plan])
    extend_lens = as_tensor([n for _, n in plan])
    starts = torch.cumsum(extend_lens, 0) - extend_lens
    num_tokens = int(extend_lens.sum())
    positions = torch.repeat_interleave(prefix_lens - starts, extend_lens) + torch.arange(num_tokens)
    input_ids = as_tensor(
        list(
            itertools.chain.from_iterable(
                req.token_ids[req.num_cached : req.num_cached + n] for req, n in plan
            )
        )
    )
    truth = [req.token_ids for req, _ in plan]
    truth_offsets = as_tensor([0, *itertools.accumulate(len(t) for t in truth)])
    token_rows = torch.repeat_interleave(rows, extend_lens).to(device)
    out_cache_loc = req_to_token[token_rows, positions.to(device)].to(torch.int64)
    return ForwardBatch(
        req_pool_indices=rows.to(device),
        prefix_lens=prefix_lens.to(device),
        extend_lens=extend_lens.to(device),
        req_to_token=req_to_token,
        input_ids=input_ids.to(device),
        positions=positions.to(device),
        out_cache_loc=out_cache_loc,
        truth_ids=as_tensor(list(itertools.chain.from_iterable(truth))).to(device),
        truth_offsets=truth_offsets.to(device),
        request_ids=tuple(req.request_id for req, _ in plan),
    )
