"""Timing jitter: seeded, bounded, reproducible draws; a no-op on the CPU; clear errors."""

from __future__ import annotations

import pytest
import torch

from kvcanary.errors import ConfigError
from kvcanary.runtime.jitter import Jitter


def test_draws_are_seeded_bounded_and_land_on_the_device_buffer():
    a, b, c = Jitter(7, 5000, 4, "cpu"), Jitter(7, 5000, 4, "cpu"), Jitter(8, 5000, 4, "cpu")
    rows_a = [a.draw() for _ in range(20)]
    assert all(torch.equal(x, b.draw()) for x in rows_a)
    assert not all(torch.equal(x, c.draw()) for x in rows_a)
    flat = torch.stack(rows_a)
    assert int(flat.min()) >= 0 and int(flat.max()) <= 5000 and len(set(flat.flatten().tolist())) > 40
    assert torch.equal(a.durations, rows_a[-1]) and a.draws == 20


def test_spin_is_a_no_op_on_the_cpu():
    j = Jitter(1, 10**9, 2, "cpu")
    j.draw()
    assert not j.active
    j.spin(1)  # would wait up to a second on a GPU
    with pytest.raises(ValueError, match=r"jitter point 2 outside \[0, 2\)"):
        j.spin(2)


@pytest.mark.parametrize(("args", "fragment"), [((1, -1, 2), "max_ns must be >= 0, got -1"),
                                                 ((1, 10, 0), "points must be >= 1, got 0")])
def test_errors(args, fragment):
    with pytest.raises(ConfigError, match=fragment):
        Jitter(*args, device="cpu")
