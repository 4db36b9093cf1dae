"""Hostile arguments to the Canary's public methods: each refused with our error naming the
argument (never a raw TypeError, KeyError, IndexError or OverflowError), on the CPU ops path and
the interpreted Triton path."""

from __future__ import annotations

import pytest
import torch

from kvcanary.errors import InputError, InputTypeError

from ._helpers import PATHS, prefilled

CASES = [
    ("tag", lambda c: c.tag("HEAD"), InputTypeError, "point must be a LaunchPoint"),
    ("end_step", lambda c: c.end_step(None), InputTypeError, "step must be an int, got NoneType"),
    ("end_step", lambda c: c.end_step(torch.arange(3)), InputTypeError, "step must be an int, got Tensor"),
    ("flush", lambda c: c.flush("7"), InputTypeError, "step must be an int, got str"),
    ("sweep_due", lambda c: c.sweep_due(-1), InputError, "step -1 out of range"),
    ("sweep", lambda c: c.sweep(None), InputTypeError, "runs must be a list of SweepRun, got NoneType"),
    ("sweep", lambda c: c.sweep([3]), InputTypeError, r"runs\[0\] must be a SweepRun, got int"),
    ("sweep", lambda c: c.sweep([], "x"), InputTypeError, "budget_bytes must be an int, got str"),
    ("hold", lambda c: c.hold([1, 2]), InputTypeError, "slots must be a tensor of signed integer slots"),
    ("hold", lambda c: c.hold(torch.tensor([1.0])), InputTypeError, "got a float32 tensor"),
    ("verify_landed", lambda c: c.verify_landed(torch.tensor([10**6])), InputError,
     r"slots\[0\] = 1000000 out of range \[0, 40\)"),
    ("verify_landed", lambda c: c.verify_landed(torch.tensor([[1]])), InputError, r"slots must be 1-D"),
    ("verify_landed", lambda c: c.verify_landed(torch.tensor([3, -2], dtype=torch.int32)), InputError,
     r"slots\[1\] = -2 out of range \[0, 40\)"),
    ("verify_landed", lambda c: c.verify_landed(torch.tensor([1]), 2**70), InputError,
     "first_position 1180591620717411303424 out of range"),
]


@pytest.mark.parametrize(("device", "fused"), PATHS[:2])
@pytest.mark.parametrize(("method", "call", "error", "match"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_hostile_argument_is_refused_before_anything_is_written(device, fused, method, call, error, match):
    c, _, _ = prefilled(3, device, 40, 12, 2, 40, fused=fused, warmup=False)
    before = [t.clone() for t in (c.state.records, c.state.ring, c.state.ring_counter, c.state.stats)]
    with pytest.raises(error, match=match):
        call(c)
    after = (c.state.records, c.state.ring, c.state.ring_counter, c.state.stats)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
