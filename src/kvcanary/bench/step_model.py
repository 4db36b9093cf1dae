"""The decoder the real-step benchmark runs: a Llama-shaped model over random weights whose
attention reads and writes a paged K/V pool.

Per layer: RMSNorm -> fused QKV product -> RoPE on q and k, k and v written into the pool at
``out_cache_loc`` -> paged attention over the page table -> output product -> residual add +
RMSNorm -> fused gate/up product -> SiLU(gate) * up -> down product -> residual add. The last
token of each request goes through the final norm and the vocabulary product. On CUDA the
elementwise stages are Triton kernels (one launch each, fused with the residual add), the products
are cuBLAS through ``torch.nn.functional.linear``; on the CPU the same math runs as torch ops.

| weight      | shape                          |
|-------------|--------------------------------|
| qkv         | [(H + 2 KVH) * D, hidden]      |
| o           | [hidden, H * D]                |
| gate_up     | [2 * mlp, hidden]              |
| down        | [hidden, mlp]                  |
| lm_head     | [vocab, hidden] (also the embedding) |
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcanary.bench.paged_attention import DecodeAttention, paged_attention_torch, prefill_attention
from kvcanary.ops.backend import cdiv, tl, triton


@dataclass(frozen=True)
class DecoderShape:
    """An 8B-shaped decoder by default (Llama-3-8B geometry)."""

    num_layers: int = 32
    hidden: int = 4096
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    mlp: int = 14336
    vocab: int = 128256
    rope_theta: float = 500000.0
    eps: float = 1e-5

    @property
    def layer_params(self) -> int:
        h, d = self.hidden, self.head_dim
        return h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h + 3 * h * self.mlp

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 2


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, eps, N: tl.constexpr, HAS_DELTA: tl.constexpr):
    """Program t: x[t] += delta[t] (when given, in place), out[t] = x[t] / rms(x[t]) * w."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, N)
    x = tl.load(x_ptr + t * N + c).to(tl.float32)
    if HAS_DELTA:
        x = x + tl.load(delta_ptr + t * N + c).to(tl.float32)
        tl.store(x_ptr + t * N + c, x.to(x_ptr.dtype.element_ty))
    r = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    w = tl.load(w_ptr + c).to(tl.float32)
    tl.store(out_ptr + t * N + c, (x * r * w).to(out_ptr.dtype.element_ty))


@triton.jit
def _rope_store_kernel(qkv_ptr, pos_ptr, loc_ptr, q_ptr, k_ptr, v_ptr, slot_stride, log2_theta,
                       NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Program (t, h): rotate head h of token t (h < H: a query head, into q[t, h]; else KV head
    h - H: k into the pool at slot loc[t], and v copied beside it). Half-split rotation:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), angle pos * theta^(-2i / D)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    half = HEAD_DIM // 2
    i = tl.arange(0, HEAD_DIM // 2)
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.exp2(-(2.0 * i / HEAD_DIM) * log2_theta)
    cos, sin = tl.cos(angle), tl.sin(angle)
    width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    src = qkv_ptr + t * width + h * HEAD_DIM
    x1 = tl.load(src + i).to(tl.float32)
    x2 = tl.load(src + half + i).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty)
    if h < NUM_HEADS:
        dst = q_ptr + (t * NUM_HEADS + h) * HEAD_DIM
        tl.store(dst + i, y1)
        tl.store(dst + half + i, y2)
    else:
        kh = h - NUM_HEADS
        slot = tl.load(loc_ptr + t)
        dst = k_ptr + slot * slot_stride + kh * HEAD_DIM
        tl.store(dst + i, y1)
        tl.store(dst + half + i, y2)
        d = tl.arange(0, HEAD_DIM)
        v = tl.load(src + NUM_KV_HEADS * HEAD_DIM + d)
        tl.store(v_ptr + slot * slot_stride + kh * HEAD_DIM + d, v)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, MLP: tl.constexpr, BLOCK: tl.constexpr):
    """Program (t, b): out[t, cols] = silu(gate[t, cols]) * up[t, cols], cols = b*BLOCK + [0, BLOCK)."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < MLP
    g = tl.load(gu_ptr + t * 2 * MLP + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * 2 * MLP + MLP + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * MLP + c, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(x, delta, w, eps, use_triton):
    """``x += delta`` in place (when given); returns ``rmsnorm(x) * w``."""
    if not use_triton:
        if delta is not None:
            x += delta
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)
    out = torch.empty_like(x)
    _rms_norm_kernel[(x.shape[0],)](x, delta if delta is not None else x, w, out, eps, N=x.shape[1],
                                    HAS_DELTA=delta is not None, num_warps=8)
    return out


def rope_store(qkv, positions, out_cache_loc, k_buffer, v_buffer, shape: DecoderShape, use_triton):
    """Roped queries ``[T, H, D]``; roped keys and the values written into the pool (side effect)."""
    n, (h, kvh, d) = qkv.shape[0], (shape.num_heads, shape.num_kv_heads, shape.head_dim)
    if not use_triton:
        x = qkv.view(n, h + 2 * kvh, d).float()
        inv = shape.rope_theta ** (-torch.arange(0, d // 2, device=qkv.device, dtype=torch.float32) * 2 / d)
        ang = positions.float()[:, None] * inv[None, :]
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(qkv.dtype)
        k_buffer[out_cache_loc] = rot[:, h: h + kvh]
        v_buffer[out_cache_loc] = qkv.view(n, h + 2 * kvh, d)[:, h + kvh:]
        return rot[:, :h].contiguous()
    q = torch.empty(n, h, d, dtype=qkv.dtype, device=qkv.device)
    _rope_store_kernel[(n, h + kvh)](qkv, positions, out_cache_loc, q, k_buffer, v_buffer, k_buffer.stride(0),
                                     math.log2(shape.rope_theta), NUM_HEADS=h, NUM_KV_HEADS=kvh, HEAD_DIM=d,
                                     num_warps=1)
    return q


def silu_mul(gu, use_triton):
    mlp = gu.shape[1] // 2
    if not use_triton:
        return (F.silu(gu[:, :mlp].float()) * gu[:, mlp:].float()).to(gu.dtype)
    out = torch.empty(gu.shape[0], mlp, dtype=gu.dtype, device=gu.device)
    _silu_mul_kernel[(gu.shape[0], cdiv(mlp, 2048))](gu, out, MLP=mlp, BLOCK=2048, num_warps=8)
    return out


class Decoder:
    """Random bf16 weights of ``shape`` and the per-layer K/V pool buffers it reads and writes."""

    def __init__(self, shape: DecoderShape, num_slots: int, device, gen: torch.Generator,
                 dtype: torch.dtype = torch.bfloat16):
        self.shape, self.device, self.dtype = shape, torch.device(device), dtype
        self.use_triton = self.device.type == "cuda"
        s, dev = shape, self.device

        def weight(*dims, scale=None):
            w = torch.empty(*dims, dtype=dtype, device=dev)
            return w.normal_(0.0, scale if scale is not None else dims[-1] ** -0.5, generator=gen)

        qkv_out = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        self.layers = [dict(qkv=weight(qkv_out, s.hidden), o=weight(s.hidden, s.num_heads * s.head_dim),
                            gate_up=weight(2 * s.mlp, s.hidden), down=weight(s.hidden, s.mlp),
                            ln1=torch.ones(s.hidden, dtype=dtype, device=dev),
                            ln2=torch.ones(s.hidden, dtype=dtype, device=dev)) for _ in range(s.num_layers)]
        self.final_norm = torch.ones(s.hidden, dtype=dtype, device=dev)
        self.lm_head = weight(s.vocab, s.hidden)
        self._weight = weight
        self.k_buffers: list[torch.Tensor] = []
        self.v_buffers: list[torch.Tensor] = []
        self.allocate_pool(num_slots)

    def allocate_pool(self, num_slots: int) -> None:
        """Per-layer K and V pool buffers of ``num_slots`` slots (random values), the old ones
        released first (a benchmark sizes the pool to each shape it runs)."""
        s = self.shape
        self.k_buffers, self.v_buffers = [], []
        kv = (num_slots, s.num_kv_heads, s.head_dim)
        self.k_buffers = [self._weight(*kv, scale=1.0) for _ in range(s.num_layers)]
        self.v_buffers = [self._weight(*kv, scale=1.0) for _ in range(s.num_layers)]

    @property
    def num_slots(self) -> int:
        return self.k_buffers[0].shape[0]

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight a step reads in full (the embedding rows it gathers are not counted)."""
        n = sum(t.numel() for layer in self.layers for t in layer.values()) + self.final_norm.numel()
        return (n + self.lm_head.numel()) * self.lm_head.element_size()

    def forward(self, batch, attn: StepAttention, logits: torch.Tensor,
                after_attention: Mapping[int, Callable[[], None]] | None = None) -> torch.Tensor:
        """One forward of ``batch`` (a ForwardBatch); writes its K/V into every layer's pool buffers
        and the last token's logits of each request into ``logits`` ([bs, vocab]).
        ``after_attention[i]`` runs once layer i has written and read its K/V (``Canary.start_tail``)."""
        s, tri = self.shape, self.use_triton
        x = self.lm_head[batch.input_ids]  # the residual stream, [T, hidden]
        h = rms_norm(x, None, self.layers[0]["ln1"], s.eps, tri)
        for i, layer in enumerate(self.layers):
            q = rope_store(F.linear(h, layer["qkv"]), batch.positions, batch.out_cache_loc, self.k_buffers[i],
                           self.v_buffers[i], s, tri)
            a = attn(q, self.k_buffers[i], self.v_buffers[i], batch)
            if after_attention and i in after_attention:
                after_attention[i]()
            h = rms_norm(x, F.linear(a.view(a.shape[0], -1), layer["o"]), layer["ln2"], s.eps, tri)
            d = F.linear(silu_mul(F.linear(h, layer["gate_up"]), tri), layer["down"])
            nxt = self.layers[i + 1]["ln1"] if i + 1 < s.num_layers else self.final_norm
            h = rms_norm(x, d, nxt, s.eps, tri)
        last = h if attn.decode else h[attn.last_token]
        torch.matmul(last, self.lm_head.t(), out=logits)
        return logits


class StepAttention:
    """Paged attention of one step shape, its launches sized once (decode: split keys; prefill:
    flash over the page table); on the CPU the torch reference."""

    def __init__(self, shape: DecoderShape, batch, decode: bool, max_len: int, max_extend: int):
        self.decode, self.max_extend = decode, max_extend
        dev = batch.input_ids.device
        self.use_triton = dev.type == "cuda"
        self.extend_starts = torch.cumsum(batch.extend_lens, 0) - batch.extend_lens
        self.last_token = torch.cumsum(batch.extend_lens, 0) - 1
        self.split = DecodeAttention(batch.batch_size, shape.num_heads, shape.num_kv_heads, shape.head_dim, max_len,
                                     dev) if decode and self.use_triton else None

    def __call__(self, q, k_buffer, v_buffer, batch):
        if not self.use_triton:
            return paged_attention_torch(q, k_buffer, v_buffer, batch.req_to_token, batch.req_pool_indices,
                                         batch.prefix_lens, batch.extend_lens)
        out = torch.empty_like(q)
        if self.decode:
            return self.split(q, k_buffer, v_buffer, batch.req_to_token, batch.req_pool_indices, batch.prefix_lens,
                              out)
        return prefill_attention(q, k_buffer, v_buffer, batch.req_to_token, batch.req_pool_indices,
                                 batch.prefix_lens, batch.extend_lens, self.extend_starts, self.max_extend, out)
