"""A tiny Llama-style transformer with random weights drawn from ``ModelConfig.seed``.

Embedding -> per layer: RMSNorm, q/k/v projections, RoPE, paged grouped-query attention (see
``attention.py``), output projection, RMSNorm, SwiGLU MLP -> final RMSNorm -> LM head. Every
activation is kept on the fixed-point grid of ``grid.py``, so in float64 a request's logits are
bit-identical whatever it is batched with and however its prefill is chunked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kvcanary.engine.attention import attention_inputs, paged_attention
from kvcanary.engine.config import ModelConfig
from kvcanary.engine.grid import to_grid
from kvcanary.engine.pool import KVPoolBase
from kvcanary.runtime.batch import ForwardBatch

RMS_EPS = 1e-6


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    wq: torch.Tensor  # [num_heads * head_dim, hidden]
    wk: torch.Tensor  # [num_kv_heads * head_dim, hidden]
    wv: torch.Tensor  # [num_kv_heads * head_dim, hidden]
    wo: torch.Tensor  # [hidden, num_heads * head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    w_gate: torch.Tensor  # [intermediate, hidden]
    w_up: torch.Tensor  # [intermediate, hidden]
    w_down: torch.Tensor  # [hidden, intermediate]


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return to_grid(x * torch.rsqrt((x * x).mean(-1, keepdim=True) + RMS_EPS) * weight)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, heads, D]; cos, sin: [T, D / 2]."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return to_grid(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))


class TinyLlama:
    """Weights live on ``device`` in ``config.dtype``; drawn on the CPU in float64 so every
    device gets the same values."""

    def __init__(self, config: ModelConfig, max_ctx: int, device: torch.device | str = "cpu"):
        self.config, self.max_ctx = config, max_ctx
        gen = torch.Generator().manual_seed(config.seed)

        def draw(*shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
            x = torch.randn(*shape, generator=gen, dtype=torch.float64) * std + mean
            return to_grid(x).to(device=device, dtype=config.dtype)

        c = config
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.embed = draw(c.vocab_size, c.hidden, std=1.0)
        self.layers = [
            LayerWeights(
                attn_norm=draw(c.hidden, std=0.1, mean=1.0),
                wq=draw(q_dim, c.hidden, std=c.hidden**-0.5),
                wk=draw(kv_dim, c.hidden, std=c.hidden**-0.5),
                wv=draw(kv_dim, c.hidden, std=c.hidden**-0.5),
                wo=draw(c.hidden, q_dim, std=q_dim**-0.5),
                mlp_norm=draw(c.hidden, std=0.1, mean=1.0),
                w_gate=draw(c.intermediate, c.hidden, std=c.hidden**-0.5),
                w_up=draw(c.intermediate, c.hidden, std=c.hidden**-0.5),
                w_down=draw(c.hidden, c.intermediate, std=c.intermediate**-0.5),
            )
            for _ in range(c.num_layers)
        ]
        self.final_norm = draw(c.hidden, std=0.1, mean=1.0)
        self.lm_head = draw(c.vocab_size, c.hidden, std=c.hidden**-0.5)
        inv_freq = c.rope_theta ** -(torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)
        angles = torch.arange(max_ctx, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.rope_cos = to_grid(torch.cos(angles)).to(device=device, dtype=c.dtype)  # [max_ctx, D / 2]
        self.rope_sin = to_grid(torch.sin(angles)).to(device=device, dtype=c.dtype)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = lambda partial: partial  # see ``shard``

    def shard(self, rank: int, num_ranks: int, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Keep rank ``rank``'s slice of every layer for tensor parallelism over ``num_ranks``:
        contiguous query and KV heads of wq/wk/wv (column-parallel) and wo (row-parallel), and of the
        MLP's intermediate dimension (gate/up column-, down row-parallel). ``reduce`` sums the
        partial outputs of wo and w_down over the ranks before they are rounded to the grid: sums of
        exact partials are exact, so the logits equal an unsharded model's bit for bit."""
        c = self.config
        for name, n in (("num_heads", c.num_heads), ("num_kv_heads", c.num_kv_heads), ("intermediate", c.intermediate)):
            if n % num_ranks:
                raise ValueError(f"ModelConfig.{name} ({n}) must be a multiple of num_ranks ({num_ranks})")
        if not 0 <= rank < num_ranks:
            raise ValueError(f"rank must be in [0, {num_ranks}), got {rank}")
        q, kv, mlp = (slice(rank * n // num_ranks, (rank + 1) * n // num_ranks)
                      for n in (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate))
        self.layers = [replace(w, wq=w.wq[q].clone(), wk=w.wk[kv].clone(), wv=w.wv[kv].clone(), wo=w.wo[:, q].clone(),
                               w_gate=w.w_gate[mlp].clone(), w_up=w.w_up[mlp].clone(), w_down=w.w_down[:, mlp].clone())
                       for w in self.layers]
        self.reduce = reduce

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, pool: KVPoolBase, max_len: int | None = None,
                layer_done: Callable[[int], None] | None = None, max_extend: int = 1) -> torch.Tensor:
        """Run ``batch``: writes K/V of its tokens into ``pool`` at ``batch.out_cache_loc`` (every
        layer), reads each request's K/V through ``batch.req_to_token``. Returns the logits of each
        request's last token: [bs, vocab_size] in the model dtype. ``max_len`` and ``max_extend``:
        the key and query widths, known on the host, so the forward makes no host sync (CUDA-graph
        capture, an eager forward; ``AttentionLayout.from_batch``). ``layer_done(i)`` runs once
        layer i has written and read its K/V."""
        c, num_tokens = self.config, batch.num_tokens
        inputs = attention_inputs(batch, pool, c.num_layers, max_len, max_extend)  # per layer: (layout, written)
        positions = batch.positions.clamp(0, self.max_ctx - 1)  # RoPE table bounds, whatever the batch says
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        h = self.embed[batch.input_ids]
        for layer, w in enumerate(self.layers):
            x = rms_norm(h, w.attn_norm)
            q = apply_rope(to_grid(x @ w.wq.T).view(num_tokens, -1, c.head_dim), cos, sin)
            k = apply_rope(to_grid(x @ w.wk.T).view(num_tokens, -1, c.head_dim), cos, sin)
            v = to_grid(x @ w.wv.T).view(num_tokens, -1, c.head_dim)
            layout, out_cache_loc = inputs[layer]
            attn = paged_attention(q, k, v, pool.k_buffers[layer], pool.v_buffers[layer], out_cache_loc, layout)
            if layer_done is not None:
                layer_done(layer)
            h = h + to_grid(self.reduce(attn.reshape(num_tokens, -1) @ w.wo.T))
            x = rms_norm(h, w.mlp_norm)
            gated = to_grid(F.silu(to_grid(x @ w.w_gate.T)) * to_grid(x @ w.w_up.T))
            h = h + to_grid(self.reduce(gated @ w.w_down.T))
        last = torch.cumsum(batch.extend_lens, 0) - 1
        return to_grid(rms_norm(h[last], self.final_norm) @ self.lm_head.T)
