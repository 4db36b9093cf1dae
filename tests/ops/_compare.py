"""The one comparison helper of the op tests: exact, with a readable diff."""

from __future__ import annotations

import torch

MAX_SHOWN = 8


def _as_tensor(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    return torch.tensor(x, dtype=torch.int64)


def assert_same(name: str, actual, expected) -> None:
    """Assert two tensors or nested int lists are equal element for element (integer ops: byte for byte).

    Tensors of different dtypes never compare equal; on mismatch the message gives the number
    of mismatching elements and the first few indices with both values.
    """
    a, b = _as_tensor(actual), _as_tensor(expected)
    if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor) and a.dtype != b.dtype:
        raise AssertionError(f"{name}: dtype {a.dtype} != {b.dtype}")
    if a.shape != b.shape:
        raise AssertionError(f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}")
    diff = a.to(torch.int64) != b.to(torch.int64)
    n_bad = int(diff.sum())
    if n_bad:
        shown = torch.nonzero(diff)[:MAX_SHOWN].tolist()
        lines = [f"  [{', '.join(map(str, i))}]: {a[tuple(i)].item()} != {b[tuple(i)].item()}" for i in shown]
        raise AssertionError(f"{name}: {n_bad} of {diff.numel()} elements differ; first {len(shown)} "
                             f"(actual != expected):\n" + "\n".join(lines))


def sorted_rows(rows) -> list[list[int]]:
    """Violation rows (a tensor or lists) as a sorted list: the ops leave row order unspecified."""
    rows = rows.tolist() if isinstance(rows, torch.Tensor) else [list(r) for r in rows]
    return sorted(rows)
