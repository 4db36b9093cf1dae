"""A fingerprint failure names the KV sources whose bytes changed: the tag's half is that of the
first differing source, and the violation's JSON carries its layer and every differing source.

A 32-layer model with layers 0 and 31 covered (sources: 0.K, 0.V, 31.K, 31.V): a V byte of layer
31 flipped reports ``TAIL.FULL.V`` with layer 31, a K byte of layer 0 ``TAIL.FULL.K`` with layer 0,
flips in two sources list both. Then, on the default model, every byte-flip fault (used slot,
cached slot, host row loaded back, which reads side words that travelled with the records) names
exactly the source it flipped."""

from __future__ import annotations

import re

import pytest

import kvcanary.faults.base as fault_base
import kvcanary.faults.used_slot_flip as used_slot_flip
from kvcanary.config import CanaryConfig
from kvcanary.core.record import Half, LaunchPoint, Reason
from kvcanary.engine.config import ModelConfig
from kvcanary.engine.workload import WorkloadConfig, builtin_workload, engine_config_for
from kvcanary.faults import CachedSlotFlip, HostRowFlip, UsedSlotFlip
from kvcanary.runs.setup import RunSetup
from kvcanary.runs.single import run_once

from ._helpers import small_setup

K, V = Half.K, Half.V


def deep_setup() -> RunSetup:
    workload = builtin_workload(WorkloadConfig(num_requests=8, seed=0))
    return RunSetup(ModelConfig(seed=0, num_layers=32), engine_config_for(workload),
                    CanaryConfig(sweep_interval=4, layers=(0, 31)), workload)


def flip_in(monkeypatch, targets: list[tuple[int, Half]]) -> None:
    """Make ``UsedSlotFlip`` flip one bit in each of ``targets`` (layer, half) of the slot it picks."""
    pick = fault_base.pick_target

    def first_target(fault):
        return targets[0] + pick(fault)[2:]

    def flip_all(engine, layer, half, slot, byte, bit):
        out = fault_base.flip_bit(engine, layer, half, slot, byte, bit)
        for other in targets[1:]:
            fault_base.flip_bit(engine, *other, slot, byte, bit)
        return out

    monkeypatch.setattr(used_slot_flip, "pick_target", first_target)
    monkeypatch.setattr(used_slot_flip, "flip_bit", flip_all)


@pytest.mark.parametrize(("targets", "tag", "layer", "sources"), [
    ([(31, V)], "TAIL.FULL.V", 31, [{"layer": 31, "half": "V"}]),
    ([(0, K)], "TAIL.FULL.K", 0, [{"layer": 0, "half": "K"}]),
    ([(31, K), (0, V)], "TAIL.FULL.V", 0, [{"layer": 0, "half": "V"}, {"layer": 31, "half": "K"}]),
], ids=["v-of-layer-31", "k-of-layer-0", "two-sources"])
def test_a_flip_is_reported_with_the_half_and_layer_it_hit(monkeypatch, targets, tag, layer, sources):
    flip_in(monkeypatch, targets)
    fault = UsedSlotFlip(seed=1, warmup_steps=6)
    out = run_once(deep_setup(), [fault])
    (inj,) = fault.injections
    first = min(out.violations, key=lambda v: v.step)
    assert (first.step, first.point, first.reasons, first.slot) == (inj.step + 1, LaunchPoint.TAIL,
                                                                    Reason.FINGERPRINT, inj.slot)
    got = first.to_json()
    assert (got["tag"], got["layer"], got["sources"]) == (tag, layer, sources)
    assert all(v.to_json()["sources"] == sources for v in out.violations)  # every re-detection names them too


def test_the_fault_free_twin_reports_nothing():
    out = run_once(deep_setup(), [])
    assert out.violations == [] and out.counts.finished > 0


@pytest.mark.parametrize("make", [lambda s: UsedSlotFlip(seed=s, warmup_steps=20),
                                  lambda s: CachedSlotFlip(seed=s, warmup_steps=20),
                                  lambda s: HostRowFlip(seed=s, warmup_steps=20)],
                         ids=["used_slot", "cached_slot", "host_row"])
@pytest.mark.parametrize("seed", [1, 2])
def test_every_byte_flip_fault_names_the_source_it_flipped(make, seed):
    fault = make(seed)
    out = run_once(small_setup(), [fault])
    (inj,) = fault.injections
    layer, half = re.search(r"layer=(\d+) half=([KV])", inj.detail).groups()
    hits = [v for v in out.violations if v.reasons & Reason.FINGERPRINT]
    assert hits, f"{fault.name} was not detected"
    for v in hits:
        assert (v.tag.half.name, v.layer, v.sources) == (half, int(layer), ((int(layer), Half[half]),)), v.line()
