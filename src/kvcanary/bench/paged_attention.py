"""Paged attention for the real-step benchmark: grouped-query attention that reads every key and
value from the pool through the page table, as a serving engine's attention backend does.

| argument          | dtype / shape              | meaning                                           |
|-------------------|----------------------------|---------------------------------------------------|
| q                 | bf16[T, H, D]              | queries, request after request (roped)            |
| k_buffer, v_buffer| bf16[num_slots, KVH, D]    | one layer's pool (the new K/V already written)    |
| req_to_token      | int32[rows, max_ctx]       | page table: (row, position) -> slot               |
| req_pool_indices  | int64[bs]                  | page-table row per request                        |
| prefix_lens       | int64[bs]                  | cached tokens before this forward                 |
| extend_lens       | int64[bs]                  | tokens this forward adds                          |
| extend_starts     | int64[bs]                  | first row of request r in q (exclusive cumsum)    |

Query ``t`` of request ``r`` sits at position ``prefix_lens[r] + col`` and sees keys
``j <= position`` (causal over the chunk and the whole prefix); query head ``h`` reads KV head
``h // (H // KVH)``. Decode (one query per request) splits each request's keys over programs and
merges the partial softmaxes in a second launch; prefill is a flash-attention forward over the
page table. Every launch has a grid fixed by capacities (``max_extend``, ``max_len``), so a step
is capturable in a CUDA graph; ``paged_attention_torch`` is the float32 reference.
"""

from __future__ import annotations

import math

import torch

from kvcanary.ops.backend import cdiv, tl, triton

LOG2E = 1.4426950408889634


def paged_attention_torch(q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens):
    """The reference: per request, gather its keys through the page table, causal softmax in float32."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_buffer.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    start = 0
    for row, p, e in zip(req_pool_indices.tolist(), prefix_lens.tolist(), extend_lens.tolist(), strict=True):
        slots = req_to_token[row, : p + e].long()
        keys = k_buffer[slots].float().repeat_interleave(group, 1)  # [L, H, D]
        values = v_buffer[slots].float().repeat_interleave(group, 1)
        qr = q[start: start + e].float()  # [e, H, D]
        scores = torch.einsum("thd,jhd->htj", qr, keys) / math.sqrt(head_dim)
        visible = torch.arange(p + e, device=q.device)[None, :] <= (p + torch.arange(e, device=q.device))[:, None]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[start: start + e] = torch.einsum("htj,jhd->thd", scores.softmax(-1), values)
        start += e
    return out.to(q.dtype)


@triton.jit
def _key_block(q, k_ptr, rtt_row_ptr, j, jm, slot_stride, kv_base, d, sm_scale_log2, MASKED: tl.constexpr):
    """Scores (log2 units) of ``q`` against the keys at page-table columns ``j`` (only where ``jm``
    when MASKED), and the offsets of those keys' rows (their values sit at the same offsets)."""
    if MASKED:
        slot = tl.load(rtt_row_ptr + j, mask=jm, other=0).to(tl.int64)
    else:
        slot = tl.load(rtt_row_ptr + j).to(tl.int64)
    kv_off = slot[:, None] * slot_stride + kv_base + d[None, :]
    if MASKED:
        k = tl.load(k_ptr + kv_off, mask=jm[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + kv_off)
    return tl.dot(q, tl.trans(k)) * sm_scale_log2, kv_off


@triton.jit
def _softmax_block(qk, v_ptrs, mask, m_i, l_i, acc, MASKED: tl.constexpr):
    """One key block of the streaming softmax: scores ``qk`` (log2 units, -inf where hidden),
    values from ``v_ptrs`` (the rows where ``mask`` when MASKED, else every row); returns the
    running max, the running sum and the unnormalised output."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    if MASKED:
        v = tl.load(v_ptrs, mask=mask[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, rtt_ptr, rpi_ptr, prefix_ptr, part_ptr, lse_ptr, rtt_stride,
                         slot_stride, chunk, num_splits, sm_scale_log2, bs, GROUP: tl.constexpr,
                         NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """Program (r * KVH + kvh, s): the GROUP query heads of KV head ``kvh`` of request ``r`` over
    keys [s * chunk, (s + 1) * chunk) of its ``prefix + 1`` keys; writes the unnormalised output
    over its keys' softmax weights and their log2-sum-exp to ``part[r, h, s]``, ``lse[r, h, s]``.
    ``bs`` only keys the tuning on CUDA."""
    pid = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    r = pid // NUM_KV_HEADS
    kvh = pid % NUM_KV_HEADS
    row = tl.load(rpi_ptr + r)
    seq_len = tl.load(prefix_ptr + r) + 1
    heads = tl.arange(0, BLOCK_H)
    hm = heads < GROUP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (r * NUM_KV_HEADS * GROUP + kvh * GROUP + heads)[:, None] * HEAD_DIM + d[None, :],
                mask=hm[:, None], other=0.0)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, HEAD_DIM), tl.float32)
    lo = s * chunk
    hi = tl.minimum(lo + chunk, seq_len)
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        jm = j < hi
        qk, kv_off = _key_block(q, k_ptr, rtt_ptr + row * rtt_stride, j, jm, slot_stride, kvh * HEAD_DIM, d,
                                sm_scale_log2, True)
        qk = tl.where(jm[None, :], qk, float("-inf"))
        m_i, l_i, acc = _softmax_block(qk, v_ptr + kv_off, jm, m_i, l_i, acc, True)
    h = r * NUM_KV_HEADS * GROUP + kvh * GROUP + heads
    live = hm & ((heads * 0 + lo) < seq_len)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(part_ptr + (h * num_splits + s)[:, None] * HEAD_DIM + d[None, :], out, mask=live[:, None])
    tl.store(lse_ptr + h * num_splits + s, tl.where(live, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)),
                                                    float("-inf")), mask=hm)


@triton.jit
def _decode_merge_kernel(part_ptr, lse_ptr, out_ptr, num_splits, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program (r * H + h): merge the splits of one query head (weights 2^(lse_s - max lse))."""
    h = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    sm = s < num_splits
    lse = tl.load(lse_ptr + h * num_splits + s, mask=sm, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = tl.where(sm, w, 0.0)
    d = tl.arange(0, HEAD_DIM)
    part = tl.load(part_ptr + (h * num_splits + s)[:, None] * HEAD_DIM + d[None, :], mask=(sm & (w > 0))[:, None],
                   other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + h * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, rtt_ptr, rpi_ptr, prefix_ptr, extend_ptr, start_ptr, rtt_stride,
                    slot_stride, sm_scale_log2, max_extend, GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (m, r * H + h): queries [m * BLOCK_M, (m + 1) * BLOCK_M) of request r's extend, head h,
    over keys [0, prefix + end of the block); blocks wholly before the first query need no mask.
    ``max_extend`` sizes the grid (and keys the tuning on CUDA)."""
    m = tl.num_programs(0).to(tl.int64) - 1 - tl.program_id(0).to(tl.int64)  # the longest rows start first
    rh = tl.program_id(1).to(tl.int64)
    num_heads = NUM_KV_HEADS * GROUP
    r = rh // num_heads
    h = rh % num_heads
    kvh = h // GROUP
    ext = tl.load(extend_ptr + r)
    if m * BLOCK_M < ext:
        row = tl.load(rpi_ptr + r)
        prefix = tl.load(prefix_ptr + r)
        start = tl.load(start_ptr + r)
        cols = m * BLOCK_M + tl.arange(0, BLOCK_M)
        qm = cols < ext
        qpos = prefix + cols
        d = tl.arange(0, HEAD_DIM)
        q_off = ((start + cols) * num_heads + h)[:, None] * HEAD_DIM + d[None, :]
        q = tl.load(q_ptr + q_off, mask=qm[:, None], other=0.0)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
        first = prefix + m * BLOCK_M
        hi = prefix + tl.minimum((m + 1) * BLOCK_M, ext)
        diag = (first // BLOCK_N) * BLOCK_N
        for j0 in range(0, diag, BLOCK_N):  # every key visible to every query of the block
            j = j0 + tl.arange(0, BLOCK_N)
            qk, kv_off = _key_block(q, k_ptr, rtt_ptr + row * rtt_stride, j, j >= 0, slot_stride, kvh * HEAD_DIM,
                                    d, sm_scale_log2, False)
            m_i, l_i, acc = _softmax_block(qk, v_ptr + kv_off, j >= 0, m_i, l_i, acc, False)
        for j0 in range(diag, hi, BLOCK_N):  # the diagonal: causal mask
            j = j0 + tl.arange(0, BLOCK_N)
            jm = j < hi
            qk, kv_off = _key_block(q, k_ptr, rtt_ptr + row * rtt_stride, j, jm, slot_stride, kvh * HEAD_DIM, d,
                                    sm_scale_log2, True)
            qk = tl.where((j[None, :] <= qpos[:, None]) & jm[None, :], qk, float("-inf"))
            m_i, l_i, acc = _softmax_block(qk, v_ptr + kv_off, jm, m_i, l_i, acc, True)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + q_off, out.to(o_ptr.dtype.element_ty), mask=qm[:, None])


# On CUDA each kernel picks its tile sizes once per shape (timed on the first call, before any
# graph capture; both kernels write only their outputs, so a timed rerun changes nothing).
# Decode is a gather of 256-byte rows: the small tiles keep more programs resident an SM (bs 256 @ 512,
# one split a head: 32 keys, 2 warps, 2 stages read 3.82 TB/s where the best of the large tiles read 3.55).
_DECODE_CONFIGS = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=st)
                   for n, w, st in ((64, 4, 3), (64, 4, 2), (128, 4, 2), (128, 8, 3), (32, 4, 4), (64, 8, 3),
                                    (32, 2, 2), (32, 4, 2), (64, 2, 2), (16, 2, 2))]
_PREFILL_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
                    for m, n, w, st in ((128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3),
                                        (128, 32, 4, 4))]
_DEFAULT_DECODE = dict(BLOCK_N=64, num_warps=4, num_stages=3)
_DEFAULT_PREFILL = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
_decode_tuned = triton.autotune(_DECODE_CONFIGS, key=["chunk", "num_splits", "bs"])(_decode_split_kernel) \
    if hasattr(triton, "autotune") else None
_prefill_tuned = triton.autotune(_PREFILL_CONFIGS, key=["max_extend"])(_prefill_kernel) \
    if hasattr(triton, "autotune") else None


class DecodeAttention:
    """Split-key decode attention with its scratch allocated once (capturable launches).

    ``max_len`` bounds ``prefix_lens + 1`` of every request; keys are split in chunks so that
    ``bs * KVH * num_splits`` programs fill the device (``target_programs``)."""

    BLOCK_N = 64  # chunks are multiples of this (the tuned tile may differ: its loop masks at the chunk end)
    MAX_SPLITS = 64  # the merge holds every split of one head in registers

    def __init__(self, bs: int, num_heads: int, num_kv_heads: int, head_dim: int, max_len: int, device,
                 target_programs: int = 2048):
        self.bs, self.num_heads, self.num_kv_heads, self.head_dim = bs, num_heads, num_kv_heads, head_dim
        blocks = cdiv(max_len, self.BLOCK_N)
        splits = max(1, min(blocks, cdiv(target_programs, bs * num_kv_heads), self.MAX_SPLITS))
        self.chunk = cdiv(blocks, splits) * self.BLOCK_N
        self.num_splits = cdiv(max_len, self.chunk)
        self.part = torch.empty(bs * num_heads * self.num_splits * head_dim, dtype=torch.float32, device=device)
        self.lse = torch.empty(bs * num_heads * self.num_splits, dtype=torch.float32, device=device)

    def __call__(self, q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, out):
        """``out`` (bf16[bs, H, D]) = attention of one query per request over its prefix + 1 keys."""
        group = self.num_heads // self.num_kv_heads
        scale = LOG2E / math.sqrt(self.head_dim)
        kernel, tiles = (_decode_tuned, {}) if q.is_cuda else (_decode_split_kernel, _DEFAULT_DECODE)
        kernel[(self.bs * self.num_kv_heads, self.num_splits)](
            q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, self.part, self.lse,
            req_to_token.stride(0), k_buffer.stride(0), self.chunk, self.num_splits, scale, self.bs, GROUP=group,
            NUM_KV_HEADS=self.num_kv_heads, HEAD_DIM=self.head_dim, BLOCK_H=max(16, triton.next_power_of_2(group)),
            **tiles)
        _decode_merge_kernel[(self.bs * self.num_heads,)](
            self.part, self.lse, out, self.num_splits, HEAD_DIM=self.head_dim,
            BLOCK_S=max(2, triton.next_power_of_2(self.num_splits)), num_warps=4)
        return out


def prefill_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens,
                      extend_starts, max_extend: int, out):
    """``out`` (bf16[T, H, D]) = causal attention of every extend token over its prefix and chunk.
    ``max_extend`` bounds ``extend_lens`` (it sizes the grid)."""
    bs, (num_heads, head_dim), num_kv_heads = req_pool_indices.shape[0], q.shape[1:], k_buffer.shape[1]
    kernel, tiles = (_prefill_tuned, {}) if q.is_cuda else (_prefill_kernel, _DEFAULT_PREFILL)
    kernel[lambda meta: (cdiv(max_extend, meta["BLOCK_M"]), bs * num_heads)](
        q, k_buffer, v_buffer, out, req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_starts,
        req_to_token.stride(0), k_buffer.stride(0), LOG2E / math.sqrt(head_dim), max_extend,
        GROUP=num_heads // num_kv_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, **tiles)
    return out


def tuned_tiles() -> dict:
    """The tile configs the last tuned launches picked (CUDA), for the benchmark's record."""
    return {name: str(getattr(k, "best_config", None)) for name, k in (("decode", _decode_tuned),
                                                                        ("prefill", _prefill_tuned))}
