"""Paged attention: write the new K/V into the pool, then read every request's keys and values
(prefix + new) back from the pool through its page-table row.

Queries are padded to ``[bs, max_extend]`` and keys to ``[bs, max_len]`` (``max_len`` = longest
``prefix_len + extend_len``), with a mask; nothing loops over tokens in Python.

| index              | meaning                                              |
|--------------------|------------------------------------------------------|
| token t            | request ``token_req[t]``, column ``token_col[t]``    |
| key j of request r | slot ``req_to_token[row_r, j]`` for ``j < seq_len_r``, slot 0 (masked) beyond |
| query t may see j  | ``j <= positions[t]`` and ``j < seq_len_r``          |

A sliding-window layer (window W) reads only keys ``j > positions[t] - W``, so request r reads
``j >= prefix_len_r - W + 1``; its slots are the window slots ``lut[req_to_token[row_r, j]]``
and its new K/V goes to ``lut[out_cache_loc]`` (``attention_inputs`` builds both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvcanary.engine.grid import to_grid
from kvcanary.runtime.batch import ForwardBatch

if TYPE_CHECKING:
    from kvcanary.engine.pool import KVPoolBase


@dataclass(frozen=True)
class AttentionLayout:
    token_req: torch.Tensor  # int64[T]
    token_col: torch.Tensor  # int64[T]
    key_slots: torch.Tensor  # int64[bs, max_len]
    key_valid: torch.Tensor  # bool[bs, max_len]
    mask: torch.Tensor  # bool[bs, max_extend, max_len]

    @classmethod
    def from_batch(cls, batch: ForwardBatch, window: int = 0, lut: torch.Tensor | None = None,
                   max_len: int | None = None, max_extend: int = 1) -> AttentionLayout:
        """The layout of ``batch``; with ``window`` > 0 a sliding-window layer's, whose slots are
        translated through ``lut`` (int64[num_slots], full slot -> window slot). ``max_len`` and
        ``max_extend``: a key width >= every sequence and a query width >= every request's extend
        (1: a decode batch), known on the host, which make the layout free of host syncs (a
        CUDA-graph capture; an eager forward whose shape the engine knows, so that the model's
        kernels are not held back until the device has run everything launched before them).
        ``max_len`` None: both read from the batch (a sync)."""
        ext, device = batch.extend_lens, batch.input_ids.device
        bs, num_tokens = batch.batch_size, batch.num_tokens
        seq_lens = batch.prefix_lens + ext
        if max_len is None:
            max_extend, max_len = int(ext.max()), int(seq_lens.max())
        token_req = torch.repeat_interleave(torch.arange(bs, device=device), ext, output_size=num_tokens)
        starts = torch.cumsum(ext, 0) - ext
        token_col = torch.arange(num_tokens, device=device) - starts[token_req]
        cols = torch.arange(max_len, device=device)
        key_valid = cols[None, :] < seq_lens[:, None]
        if window:
            key_valid &= cols[None, :] > (batch.prefix_lens - window)[:, None]
        rows = batch.req_to_token[batch.req_pool_indices, :max_len].to(torch.int64)
        if lut is not None:
            rows = lut[rows]
        key_slots = torch.where(key_valid, rows, 0)
        query_pos = (seq_lens - 1)[:, None].repeat(1, max_extend)  # padding queries see every key
        query_pos[token_req, token_col] = batch.positions
        mask = (cols[None, None, :] <= query_pos[:, :, None]) & key_valid[:, None, :]
        if window:
            mask &= cols[None, None, :] > query_pos[:, :, None] - window
        return cls(token_req, token_col, key_slots, key_valid, mask)


def attention_inputs(batch: ForwardBatch, pool: KVPoolBase, num_layers: int, max_len: int | None = None,
                     max_extend: int = 1) -> list[tuple[AttentionLayout, torch.Tensor]]:
    """Per layer: the layout it reads and the slots it writes its new K/V to (``out_cache_loc``
    for a full-attention layer, ``lut[out_cache_loc]`` for a sliding-window layer); ``max_len``
    and ``max_extend`` as in ``AttentionLayout.from_batch``."""
    full = (AttentionLayout.from_batch(batch, max_len=max_len, max_extend=max_extend), batch.out_cache_loc)
    window = pool.window
    if window is None:
        return [full] * num_layers
    swa = (AttentionLayout.from_batch(batch, window.window, window.lut, max_len, max_extend),
           window.lut[batch.out_cache_loc])
    return [swa if layer in window.layers else full for layer in range(num_layers)]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out_cache_loc: torch.Tensor,
    layout: AttentionLayout,
) -> torch.Tensor:
    """Grouped-query attention over the pool.

    q: [T, H, D]; k, v: [T, KVH, D]; k_buffer, v_buffer: [num_slots, KVH, D]; out_cache_loc:
    int64[T]. Writes ``k``/``v`` into the buffers at ``out_cache_loc`` (side effect), then
    gathers all keys from the buffers. Returns [T, H, D].
    """
    k_buffer[out_cache_loc] = k
    v_buffer[out_cache_loc] = v
    num_tokens, num_heads, head_dim = q.shape
    bs, max_len = layout.key_slots.shape
    num_kv_heads, max_extend = k_buffer.shape[1], layout.mask.shape[1]
    group = num_heads // num_kv_heads
    padded = q.new_zeros(bs, max_extend, num_heads, head_dim)
    padded[layout.token_req, layout.token_col] = q
    # query head h reads KV head h // group: [bs, KVH, group * max_extend, D]
    queries = padded.view(bs, max_extend, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    queries = queries.reshape(bs, num_kv_heads, group * max_extend, head_dim)
    keys = k_buffer[layout.key_slots].permute(0, 2, 1, 3)  # [bs, KVH, max_len, D]
    values = (
        v_buffer[layout.key_slots].masked_fill(~layout.key_valid[:, :, None, None], 0).permute(0, 2, 1, 3)
    )
    scores = to_grid(queries @ keys.transpose(-1, -2) * head_dim**-0.5)
    scores = scores.view(bs, num_kv_heads, group, max_extend, max_len)
    scores = scores.masked_fill(~layout.mask[:, None, None], float("-inf"))
    weights = to_grid(torch.exp(scores - scores.amax(-1, keepdim=True)))
    weights = weights.view(bs, num_kv_heads, group * max_extend, max_len)
    out = to_grid((weights @ values) / weights.sum(-1, keepdim=True))
    out = out.view(bs, num_kv_heads, group, max_extend, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(bs, max_extend, num_heads, head_dim)[layout.token_req, layout.token_col]
