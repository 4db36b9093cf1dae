"""Records travel with K/V: an offload / load-back round trip keeps every canary row byte-equal."""

from __future__ import annotations

import pytest
import torch

from kvcanary.engine.canary_hooks import CanaryHooks
from kvcanary.engine.engine import Engine
from kvcanary.runs.driver import run_workload

from ._helpers import small_setup


class RoundTripHooks(CanaryHooks):
    """CanaryHooks that remember each offloaded slot's record and K/V, and compare them on load-back."""

    def __init__(self, config):
        super().__init__(config)
        self.sent: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # host row -> (record, kv bytes)
        self.num_checked = 0
        self.devices: set[str] = set()  # where the slots and host rows the pool handed the hooks lay

    def kv(self, slots: torch.Tensor) -> torch.Tensor:
        pool = self.engine.pool
        parts = [buf[slots].reshape(len(slots), -1) for buf in pool.k_buffers + pool.v_buffers]
        return torch.cat(parts, dim=1).contiguous().view(torch.uint8).clone()

    def on_offload(self, device_slots, host_rows):
        self.devices |= {device_slots.device.type, host_rows.device.type}
        super().on_offload(device_slots, host_rows)
        records, kv = self.canary.export_rows(device_slots), self.kv(device_slots)
        assert torch.equal(self.canary.host_rows[host_rows], records), "host mirror != device records + side words"
        for i, row in enumerate(host_rows.tolist()):
            self.sent[row] = (records[i], kv[i])

    def on_load(self, host_rows, device_slots):
        self.devices |= {device_slots.device.type, host_rows.device.type}
        super().on_load(host_rows, device_slots)
        records, kv = self.canary.export_rows(device_slots), self.kv(device_slots)
        for i, row in enumerate(host_rows.tolist()):
            want_record, want_kv = self.sent[row]
            assert torch.equal(records[i], want_record), f"host row {row} -> slot {int(device_slots[i])}: record"
            assert torch.equal(kv[i], want_kv), f"host row {row} -> slot {int(device_slots[i])}: K/V"
            self.num_checked += 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_offload_and_load_back_keep_records_byte_equal(device):
    setup = small_setup(num_requests=48, engine={"device": device})
    hooks = RoundTripHooks(setup.canary)
    engine = Engine(setup.model, setup.engine, hooks)
    hooks.attach(engine)
    run_workload(engine, setup.workload)
    hooks.canary.flush(engine.step_index)
    stats = engine.stats
    assert stats.num_offloaded_slots > 0 and hooks.num_checked == stats.num_loaded_slots > 0
    assert hooks.canary.totals.violations == 0 and hooks.reports == []
    # the pool hands the hooks its slots on the host, where the canary checks them without a device read
    assert hooks.devices == {"cpu"}
    # every load-back was verified at once (SWEEP launches beyond the periodic sweeps)
    assert hooks.canary.counters()["SWEEP"]["launches"] > hooks.canary.totals.sweeps
