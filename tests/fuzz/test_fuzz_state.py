"""The mutated-state family of tests/fuzz/fuzz_state.py: valid built objects (state, workspaces,
plan, write marks, KV sources and their set, the bound launches over them) mutated in place,
then used. Every mutated case raises one of our errors before any byte changed, identically on
every backend, except on ``BoundForward``, which holds the memory it was bound to: there the
mutation must change nothing it does. Every unmutated twin runs. ``-m slow`` runs thousands
more cases."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvcanary.ops._common import HAS_TRITON

from .fuzz_state import OPS, fuzz

pytestmark = [pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed"),
              pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton kernels run under the interpreter on "
                                 "CPU tensors; with a GPU they would be compiled for it instead")]


def check(seeds) -> Counter:
    counts = Counter()
    problems = fuzz(seeds, counts)
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:20])
    return counts


def test_mutated_state_is_refused_before_any_write():
    counts = check(range(400))
    refused = sum(v for (_, kind), v in counts.items() if kind == "refused")
    ran = sum(v for (_, kind), v in counts.items() if kind == "ok")
    # both halves exercised: most cases mutate and are refused, the unmutated twins run
    assert refused >= 250 and ran >= 25, dict(counts)
    for op in OPS:  # every op and bound launch drew mutated cases
        assert counts[op, "refused"] + counts[op, "unaffected"] + counts[op, "skipped"] >= 5, (op, dict(counts))


@pytest.mark.slow
def test_mutated_state_long():
    check(range(400, 5400))
