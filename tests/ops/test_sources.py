"""SourceSet: the sources of a state with their mode and table, checked once; an op given one
takes it as built and computes what it computes from the loose sources, byte for byte."""

from __future__ import annotations

import pytest
import torch

from kvcanary.core.record import Half
from kvcanary.errors import InputError, InputTypeError
from kvcanary.ops import DeviceState, FingerprintMode, KVSource, SourceSet, fingerprint
from kvcanary.ops.sources import source_meta

NUM_SLOTS = 40


def _sources(seed: int, num_slots: int = NUM_SLOTS) -> list[KVSource]:
    gen = torch.Generator().manual_seed(seed)
    return [KVSource.from_buffer(torch.randn(num_slots, 2, 8, generator=gen), half=half, layer=layer)
            for layer in (0, 3) for half in (Half.K, Half.V)]


@pytest.mark.parametrize("mode", [FingerprintMode.PARTIAL, FingerprintMode.ALL])
def test_build_checks_once_and_keeps_the_table(mode):
    sources = _sources(1)
    kv = SourceSet.build(sources, mode, NUM_SLOTS, torch.device("cpu"))
    assert kv.sources == tuple(sources) and kv.mode is mode and kv.list() == sources
    assert torch.equal(kv.meta, source_meta(sources, mode, "cpu"))
    assert SourceSet.resolve(kv, FingerprintMode.NONE, None, NUM_SLOTS, "cpu") is kv  # taken as built


def test_mode_none_reads_no_source():
    kv = SourceSet.build(["not a source"], FingerprintMode.NONE, NUM_SLOTS, "cpu")
    assert kv.sources == () and kv.meta is None


@pytest.mark.parametrize(("args", "error", "match"), [
    ((["k"], FingerprintMode.ALL), InputTypeError, r"sources\[0\] must be a KVSource, got str"),
    ((_sources(2) + _sources(3)[:1], FingerprintMode.ALL), InputError, "5 KV sources > 4"),
    ((_sources(2, NUM_SLOTS - 7), FingerprintMode.PARTIAL), InputError,
     r"sources\[0\] covers 33 slots < the canary's 40"),
    ((_sources(2), "partial"), InputTypeError, "mode must be a FingerprintMode, got 'partial'"),
])
def test_build_names_what_is_wrong(args, error, match):
    with pytest.raises(error, match=match):
        SourceSet.build(*args, NUM_SLOTS, "cpu")


def test_a_set_for_another_state_is_refused():
    kv = SourceSet.build(_sources(4, 24), FingerprintMode.PARTIAL, 24, "cpu")
    with pytest.raises(InputError, match="SourceSet built for 24 slots on cpu, used for 40 on cpu"):
        SourceSet.resolve(kv, FingerprintMode.PARTIAL, None, NUM_SLOTS, "cpu")


@pytest.mark.parametrize("mode", [FingerprintMode.PARTIAL, FingerprintMode.ALL])
def test_an_op_given_the_set_computes_what_it_computes_from_the_sources(mode):
    sources = _sources(5)
    slots = torch.randint(-2, NUM_SLOTS + 3, (64,), generator=torch.Generator().manual_seed(6))
    states = [DeviceState.allocate(NUM_SLOTS) for _ in range(2)]
    loose = fingerprint(slots=slots, sources=sources, mode=mode, state=states[0], record=True)
    kv = SourceSet.build(sources, mode, NUM_SLOTS, "cpu")
    bundled = fingerprint(slots=slots, sources=kv, mode=mode, state=states[1], record=True)
    assert torch.equal(loose, bundled) and int((loose != 0).sum()) > 0
    assert torch.equal(states[0].records, states[1].records)
    assert torch.equal(states[0].source_tags, states[1].source_tags)
