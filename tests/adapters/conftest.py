from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")


@pytest.fixture(autouse=True, scope="module")
def cpu_swap_pool():
    """Let transformers' CPU offloading run without an accelerator (see _setup._UnpinnedTorch)."""
    if torch.cuda.is_available():
        yield
        return
    from transformers.generation.continuous_batching import offloading_manager

    from ._setup import _UnpinnedTorch

    saved = offloading_manager.torch
    offloading_manager.torch = _UnpinnedTorch("torch")
    yield
    offloading_manager.torch = saved
