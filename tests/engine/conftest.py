from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """The engine's tensors are tiny: on a small shared box, OpenMP barriers between threads cost
    far more than the math (a [10, 64] x [64, 256] float64 matmul: ~20 us on 1 thread, up to ms on 2)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
