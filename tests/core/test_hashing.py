from __future__ import annotations

import pytest
import torch

from kvcanary.core import hashing as H

# Regression vectors: computed once from the scalar functions and pinned.
TOKENS = [1, 2, 3, 50256, 0]
CHAIN_FROM_ANCHOR = [0x4B5643414E415259, 0x004D4D5CF4916234, 0x197DBD40191016F1, 0xAC2F0DB354F8D2BD,
                     0xE1A38AC3AA425ABA]
CHAIN_FROM_SEED_AT_7 = [0x3039, 0x7B2FD99CD6AB54A2, 0x415B07E3404F40FA, 0x02597DD875D375AE, 0xB7281E1F249DA50E]
LINKS = {(0, 0): 0x47D1F729AF61BEAD, (50256, 4): 0x1204F1A9D3AB44D2, (-1, 2**63): 0xA07B3B7633140579}

EXTREMES = [0, 1, -1, 2**63 - 1, -(2**63), 2**31 - 1, -(2**31), 2**32, 0x5555555555555555, -0x5555555555555556]


@pytest.mark.parametrize("x, want", [(1, 0x5692161D100B05E5), (0xFFFFFFFFFFFFFFFF, 0xB4D055FCF2CBBD7B),
                                     (0x8000000000000000, 0x25C26EA579CEA98A)])
def test_splitmix64_pinned_vectors(x, want):
    assert H.splitmix64(x) == want
    assert H.splitmix64(x - (1 << 64)) == want  # the same bit pattern as a negative int


def test_chain_values_pinned():
    assert H.chain_values(TOKENS) == CHAIN_FROM_ANCHOR
    assert H.chain_values(TOKENS, start_position=7, seed=12345) == CHAIN_FROM_SEED_AT_7
    assert {k: H.link(*k) for k in LINKS} == LINKS


def test_chain_is_anchor_plus_sum_of_links():
    chain = H.chain_values(TOKENS)
    assert chain[0] == H.ANCHOR
    for p in range(1, len(TOKENS)):
        assert chain[p] == (chain[p - 1] + H.link(TOKENS[p - 1], p - 1)) & H.MASK64
    # continuing from the predecessor's record gives the same values as one long chain
    tail = H.chain_values(TOKENS[2:], start_position=2, seed=(chain[1] + H.link(TOKENS[1], 1)) & H.MASK64)
    assert tail == chain[2:]
    assert H.chain_values([]) == []


def test_link_depends_on_token_and_position():
    assert H.link(5, 3) != H.link(5, 4)
    assert H.link(5, 3) != H.link(6, 3)
    assert H.link(3, 5) != H.link(5, 3)


def test_signed_unsigned_round_trip():
    for x in EXTREMES:
        assert H.to_signed(H.to_unsigned(x)) == x
        assert 0 <= H.to_unsigned(x) <= H.MASK64
    assert H.to_signed(0xFFFFFFFFFFFFFFFF) == -1
    assert H.to_signed(0x8000000000000000) == -(2**63)
    assert H.ANCHOR_S == H.to_signed(H.ANCHOR)


def _random_int64(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-(2**63), 2**63 - 1, (n,), generator=gen)
    return torch.cat([x, torch.tensor(EXTREMES, dtype=torch.int64)])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_splitmix64_torch_matches_scalar(seed):
    x = _random_int64(2000, seed)
    got = H.splitmix64_torch(x)
    assert got.dtype == torch.int64
    assert got.tolist() == [H.to_signed(H.splitmix64(v)) for v in x.tolist()]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_link_torch_matches_scalar(seed):
    tokens = _random_int64(2000, seed)
    positions = _random_int64(2000, seed + 100)
    positions[:500] = torch.arange(500)  # real positions are small
    got = H.link_torch(tokens, positions)
    assert got.dtype == torch.int64
    assert got.tolist() == [H.to_signed(H.link(t, p)) for t, p in zip(tokens.tolist(), positions.tolist(), strict=True)]


def test_link_torch_broadcasts_and_accepts_int32():
    tokens = torch.tensor([[7], [50256]], dtype=torch.int32)
    positions = torch.arange(4, dtype=torch.int32)
    got = H.link_torch(tokens, positions)
    assert got.shape == (2, 4)
    assert got.tolist() == [[H.to_signed(H.link(t, p)) for p in range(4)] for t in (7, 50256)]


def test_chain_by_cumsum_of_torch_links():
    # the stamp kernels' scan: ANCHOR + exclusive prefix sum of links, with int64 wrap-around
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 50_000, (300,), generator=gen)
    links = H.link_torch(tokens, torch.arange(300))
    chain = H.ANCHOR_S + torch.cumsum(links, 0) - links
    assert chain.tolist() == [H.to_signed(c) for c in H.chain_values(tokens.tolist())]
