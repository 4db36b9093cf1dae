"""Which halves vLLM's CPU cache kernel stores by token, found by writing one token and reading it back."""

from __future__ import annotations

import torch

from kvcanary import Half
from kvcanary.adapters.vllm.layouts import Geometry, Layout, logical_views


def token_major_halves(dtype: torch.dtype, block_size: int, num_heads: int, head_dim: int) -> tuple[Half, ...]:
    """The halves whose token rows sit where ``layouts.logical_views`` expects them (Layout.CPU)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm import _custom_ops as ops

    isa = _get_attn_isa(dtype, block_size, head_dim, "auto")
    kv = torch.zeros(2, num_heads, block_size, 2 * head_dim, dtype=dtype)
    k_cache, v_cache = kv.view(2, num_heads, 2 * block_size, head_dim).chunk(2, dim=2)
    values = (torch.arange(num_heads * head_dim) % 250 + 1).to(dtype).view(1, num_heads, head_dim)
    offset = block_size // 2 + 1  # a token in the middle of block 1: neither edge of a row or a tile
    ops.cpu_attn_reshape_and_cache(values, -values, k_cache, v_cache, torch.tensor([block_size + offset]), isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    k, v = logical_views(kv, Layout.CPU, Geometry(2, block_size, num_heads, head_dim))
    out = []
    for half, view, want in ((Half.K, k, values[0]), (Half.V, v, -values[0])):
        if torch.equal(view[1, offset], want) and int(view.count_nonzero()) == want.numel():
            out.append(half)
    return tuple(out)
