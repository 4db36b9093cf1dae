from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    """The engine's matmuls are tiny: one thread beats the OpenMP barriers of several. Module scope:
    set before any module-scoped run fixture."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
