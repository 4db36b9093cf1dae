"""The compiled CPU truth scatter's source (numba, compiled by ``ops._cpu`` on first use, as
``_cpu_kernels``' are): ``_scatter`` reproduces ``scatter._scatter_torch`` byte for byte;
``INLINED`` / ``CALLED`` / ``KERNELS`` tell ``ops._cpu`` how it compiles."""

from __future__ import annotations

import numpy as np


def _scatter_bad(flat, offsets, rpi, rows, starts, has_starts):
    """(bad offsets, bad rows) of a truth scatter: offsets that do not run from 0 to len(flat)
    without decreasing (or not bs + 1 of them), with ``has_starts`` a negative start (or not bs
    of them), rows outside the table."""
    n, bs = flat.shape[0], rpi.shape[0]
    if offsets.shape[0] != bs + 1 or (has_starts and starts.shape[0] != bs):
        return True, False
    bad_off = offsets[0] != 0 or offsets[bs] != n
    bad_rows = False
    for r in range(bs):
        bad_off = bad_off or offsets[r + 1] < offsets[r] or (has_starts and starts[r] < 0)
        bad_rows = bad_rows or rpi[r] < 0 or rpi[r] >= rows
    return bad_off, bad_rows


def _scatter_rows(flat, offsets, rpi, out, lens, has_lens, starts, has_starts):
    """Copy every valid segment into its row of ``out``, from column 0 or (``has_starts``) from
    its start on, nothing past the row's width; ``has_lens``: each segment's length too (plus
    its start: the length of the history the row then holds)."""
    n, bs = flat.shape[0], rpi.shape[0]
    rows, width = out.shape[0], out.shape[1]
    for r in range(bs):
        a, b, row = offsets[r], offsets[r + 1], rpi[r]
        first = starts[r] if has_starts else 0
        if has_lens:
            lens[r] = first + b - a
        if 0 <= a <= b <= n and 0 <= row < rows and first >= 0:
            for c in range(max(min(b - a, width - first), 0)):
                out[row, first + c] = np.int32(flat[a + c])


def _scatter(flat, offsets, rpi, out, error_flag, lens, has_lens, strict, starts, has_starts):
    """``scatter._scatter_torch``: flag bad offsets (1) and rows (2), copy every valid segment;
    ``has_lens``: also each request's segment length into ``lens``; ``has_starts``: segments are
    appends, each from its column in ``starts`` on. ``strict``: bad offsets, starts or rows
    write nothing (no flag either) and return 1, for a caller that raises
    ``validate_scatter``'s error instead; else returns 0."""
    bad_off, bad_rows = _scatter_bad(flat, offsets, rpi, out.shape[0], starts, has_starts)
    if strict and (bad_off or bad_rows):
        return 1
    error_flag[0] |= np.int32(bad_off) * 1 | np.int32(bad_rows) * 2
    bs = rpi.shape[0]
    if offsets.shape[0] != bs + 1 or (has_starts and starts.shape[0] != bs) or (has_lens and lens.shape[0] < bs):
        return 0  # arrays of the wrong length (the op checks them first): flagged, nothing read past them
    _scatter_rows(flat, offsets, rpi, out, lens, has_lens, starts, has_starts)
    return 0


_SCATTER_SIG = ("int64(int64[::1], int64[::1], int64[::1], int32[:, :], int32[::1], int64[::1], boolean, boolean, "
                "int64[::1], boolean)")
INLINED = ()
CALLED = ("_scatter_bad", "_scatter_rows")
KERNELS = {"scatter": ("_scatter", _SCATTER_SIG)}
