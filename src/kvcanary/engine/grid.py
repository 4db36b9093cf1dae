"""A fixed-point grid that makes float64 inference exact, hence batch-invariant.

Float sums depend on their order, and BLAS picks the order from the matrix shape: on MKL a
float64 ``x[:1] @ W`` and ``x[:5] @ W`` differ in the first row by ~1e-14, and a sum padded with
zeros differs from the unpadded one. So a request's logits would depend on what it is batched
with and on how its prefill is chunked.

Rounding every matmul input (and every activation) to a multiple of ``2**-GRID_BITS`` makes
each product exact and each partial sum an integer multiple of ``2**-(2 * GRID_BITS)``; while
the sums stay below ``2**(53 - 2 * GRID_BITS)`` (the default model stays far below), every
order gives the same bits. Only elementwise ops are left to round, and they do not depend on
the batch. Other dtypes skip the grid and are not batch-invariant.
"""

from __future__ import annotations

import torch

GRID_BITS = 16
_SCALE = float(2**GRID_BITS)


def to_grid(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the nearest multiple of ``2**-GRID_BITS`` (float64 only; others unchanged)."""
    if x.dtype != torch.float64:
        return x
    return torch.round(x * _SCALE) / _SCALE
