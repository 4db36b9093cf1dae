"""splitmix64, the per-token link and the additive prefix chain.

Every value is a 64-bit pattern. Scalar functions work on Python ints (mod 2**64); the
``*_torch`` functions work on ``torch.int64`` tensors, whose multiply wraps, with logical
right shifts emulated by masking. The Triton twins live in ``kvcanary.ops._jit``.

The chain entering position p of a sequence t_0 t_1 ... is::

    chain(p) = ANCHOR + sum_{i < p} link(t_i, i)   (mod 2**64)

so stamping n tokens is an exclusive prefix sum of their links, and verifying a slot needs
only its predecessor's record: chain[s] == chain[q] + link(token[q], position[q]).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MASK64 = (1 << 64) - 1
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
GOLDEN = 0x9E3779B97F4A7C15
TOKEN_SALT = 0x6B762D63616E6172  # "kv-canar"
ANCHOR = 0x4B5643414E415259  # "KVCANARY": the chain entering position 0


def to_signed(x: int) -> int:
    """The int64 value with the same bit pattern as the 64-bit unsigned ``x``."""
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def to_unsigned(x: int) -> int:
    return x & MASK64


def splitmix64(x: int) -> int:
    """splitmix64 finaliser: a bijection on 64-bit values; returns the unsigned result."""
    z = x & MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def link(token: int, position: int) -> int:
    """The chain increment contributed by ``token`` at ``position`` (unsigned)."""
    h = splitmix64((token & MASK64) ^ TOKEN_SALT)
    return splitmix64(h ^ ((position * GOLDEN) & MASK64))


def chain_values(tokens: Sequence[int], start_position: int = 0, seed: int = ANCHOR) -> list[int]:
    """Chain entering each token of ``tokens`` (unsigned), the first at ``start_position``.

    ``seed`` is the chain entering ``start_position``: ANCHOR for a sequence head, otherwise
    ``chain[q] + link(token[q], position[q])`` of the predecessor q.
    """
    out, acc = [], seed & MASK64
    for i, tok in enumerate(tokens):
        out.append(acc)
        acc = (acc + link(tok, start_position + i)) & MASK64
    return out


# --- torch (int64, wrapping) ------------------------------------------------------------

_MIX1_S = to_signed(MIX1)
_MIX2_S = to_signed(MIX2)
_GOLDEN_S = to_signed(GOLDEN)
_TOKEN_SALT_S = to_signed(TOKEN_SALT)
ANCHOR_S = to_signed(ANCHOR)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64_torch(x: torch.Tensor) -> torch.Tensor:
    """Elementwise splitmix64 of an int64 tensor; returns int64 bit patterns."""
    z = x.to(torch.int64)
    z = (z ^ _shr(z, 30)) * _MIX1_S
    z = (z ^ _shr(z, 27)) * _MIX2_S
    return z ^ _shr(z, 31)


def link_torch(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Elementwise ``link`` of int64 tensors (broadcasting); returns int64 bit patterns."""
    h = splitmix64_torch(tokens.to(torch.int64) ^ _TOKEN_SALT_S)
    return splitmix64_torch(h ^ (positions.to(torch.int64) * _GOLDEN_S))
