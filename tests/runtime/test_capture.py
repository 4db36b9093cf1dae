"""``runtime.capture.collection_paused``: the garbage collector is off inside (no collection can
run during a CUDA graph capture) and as it was afterwards, also when the body raises or when it
was off already."""

from __future__ import annotations

import gc

import pytest

from kvcanary.runtime.capture import collection_paused


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("raises", [False, True])
def test_the_collector_is_off_inside_and_as_it_was_after(enabled, raises):
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    collected = []
    watch = lambda phase, info: collected.append(phase)  # noqa: E731
    gc.callbacks.append(watch)
    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)  # a collection at nearly every allocation, where the collector is on
    inside = None
    try:
        with pytest.raises(RuntimeError) if raises else _nothing():
            with collection_paused():
                assert not gc.isenabled()
                collected.clear()  # those before it
                junk = [[object()] for _ in range(2000)]  # allocations that would trigger collections
                del junk
                inside = list(collected)  # the collections that ran inside, up to its end
                if raises:
                    raise RuntimeError("inside")
        assert inside == []
        assert gc.isenabled() is enabled
        junk = [[object()] for _ in range(2000)]
        del junk
        assert bool(collected) is enabled  # the collector, on again, collects at once
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(watch)
        (gc.enable if was else gc.disable)()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
