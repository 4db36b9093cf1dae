"""What every CUDA graph capture here runs inside."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collection_paused() -> Iterator[None]:
    """No garbage collection inside (the collector as it was afterwards, also on an error): torch
    no longer collects before a capture (2.9 on), and a collection inside one that frees another
    graph or a pinned buffer invalidates it."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
