"""The real-step benchmark's paged-attention kernels against the float32 torch reference, on tiny
shapes (Triton under TRITON_INTERPRET=1 on the CPU): random page tables, odd lengths, padding.
On the CPU the inputs are float32: the interpreter's ``tl.dot`` of bfloat16 tiles returns garbage
(triton 3.9), and the kernels take their dot dtype from their inputs."""

from __future__ import annotations

import pytest
import torch

from kvcanary.bench.paged_attention import DecodeAttention, paged_attention_torch, prefill_attention

DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float32
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _pool(gen, num_slots=1000, kv_heads=2, head_dim=32):
    k = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(DTYPE).to(DEV)
    v = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(DTYPE).to(DEV)
    return k, v


def _table(gen, rows, max_ctx, num_slots):
    slots = torch.randperm(num_slots - 1, generator=gen)[: (rows - 1) * max_ctx] + 1
    table = torch.zeros(rows, max_ctx, dtype=torch.int32)
    table[1:] = slots.view(rows - 1, max_ctx).to(torch.int32)
    return table.to(DEV)


def _close(got, want):
    diff = (got.float() - want.float()).abs()
    bad = diff > 2e-2 + 2e-2 * want.float().abs()
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} values differ; first at "
                           f"{bad.nonzero()[:4].tolist()}: got {got.float()[bad][:4].tolist()}, "
                           f"want {want.float()[bad][:4].tolist()}")


@pytest.mark.parametrize("seed, prefix", [(0, [5, 130, 63]), (1, [0, 1, 200])])
def test_decode_matches_reference(seed, prefix):
    gen = torch.Generator().manual_seed(seed)
    k, v = _pool(gen)
    table = _table(gen, 5, 201, 1000)
    rpi = torch.tensor([3, 1, 4], device=DEV)
    pl = torch.tensor(prefix, device=DEV)
    q = torch.randn(3, 4, 32, generator=gen).to(DTYPE).to(DEV)
    attn = DecodeAttention(3, 4, 2, 32, max_len=201, device=DEV, target_programs=24)
    assert attn.num_splits > 1  # the merge of several splits is exercised
    out = attn(q, k, v, table, rpi, pl, torch.empty_like(q))
    _close(out, paged_attention_torch(q, k, v, table, rpi, pl, torch.ones(3, dtype=torch.int64, device=DEV)))


@pytest.mark.parametrize("seed, prefix, extend", [(0, [0, 0], [130, 7]), (1, [70, 3], [65, 1])])
def test_prefill_matches_reference(seed, prefix, extend):
    gen = torch.Generator().manual_seed(seed)
    k, v = _pool(gen)
    table = _table(gen, 4, 140, 1000)
    rpi, pl, el = (torch.tensor(x, device=DEV) for x in ([2, 3], prefix, extend))
    starts = torch.cumsum(el, 0) - el
    q = torch.randn(int(el.sum()), 4, 32, generator=gen).to(DTYPE).to(DEV)
    out = prefill_attention(q, k, v, table, rpi, pl, el, starts, int(el.max()), torch.empty_like(q))
    _close(out, paged_attention_torch(q, k, v, table, rpi, pl, el))


def test_reference_is_causal():
    """A later key must not change an earlier query's output (the reference's own mask)."""
    gen = torch.Generator().manual_seed(2)
    k, v = _pool(gen)
    table = _table(gen, 2, 20, 1000)
    q = torch.randn(20, 4, 32, generator=gen).to(DTYPE).to(DEV)
    args = (table, *(torch.tensor([x], device=DEV) for x in (1, 0, 20)))
    before = paged_attention_torch(q, k, v, *args)
    k[table[1, 19].long()] += 1
    after = paged_attention_torch(q, k, v, *args)
    assert torch.equal(before[:19], after[:19]) and not torch.equal(before[19], after[19])
