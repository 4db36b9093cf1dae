"""The fuzz suite of tests/fuzz/fuzz_ops.py: seeded cases per op on the torch path and the Triton
kernel (interpreted on CPU). Every case either raises one of our errors before any state changed,
or succeeds on both backends with the same bytes and untouched guards. The default run takes
a few hundred cases per op; ``-m slow`` runs thousands more."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvcanary.ops._common import HAS_TRITON

from .fuzz_ops import CASES, fuzz

pytestmark = [pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed"),
              pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton kernels run under the interpreter on "
                                 "CPU tensors; with a GPU they would be compiled for it instead")]

DEFAULT_CASES = 250
SLOW_CASES = 3000
COUNTS: Counter = Counter()  # (op, outcome) -> cases, printed at the end of the session (conftest.py)


def check(op: str, seeds) -> None:
    counts = Counter()
    problems = fuzz(op, seeds, counts)
    COUNTS.update(counts)
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:20])
    ok = counts[op, "ok"]
    errors = sum(v for (o, kind), v in counts.items() if o == op and kind not in ("ok", "problem"))
    # both halves of the promise are exercised: inputs that run, and inputs that are refused
    assert ok >= len(seeds) // 5 and errors >= len(seeds) // 5, dict(counts)


@pytest.mark.parametrize("op", list(CASES))
def test_fuzz(op):
    check(op, range(DEFAULT_CASES))


@pytest.mark.slow
@pytest.mark.parametrize("op", list(CASES))
def test_fuzz_long(op):
    check(op, range(DEFAULT_CASES, DEFAULT_CASES + SLOW_CASES))
