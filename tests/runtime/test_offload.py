"""Records travel with K/V: an offload / load-back round trip keeps every canary row byte-equal."""

from __future__ import annotations

import pytest
import torch

from kvcanary.core.record import FINGERPRINT, Reason
from kvcanary.engine.canary_hooks import CanaryHooks
from kvcanary.engine.engine import Engine
from kvcanary.errors import KVCanaryError
from kvcanary.runs.driver import run_workload

from ._helpers import prefilled, read_all, small_setup


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
        records, kv = self.canary.export_rows(device_slots).cpu(), self.kv(device_slots).cpu()
        assert torch.equal(self.canary.host_rows[host_rows], records), "host mirror != device records + side words"
        for i, row in enumerate(host_rows.tolist()):
            self.sent[row] = (records[i], kv[i])

    def on_load(self, host_rows, device_slots):
        self.devices |= {device_slots.device.type, host_rows.device.type}
        super().on_load(host_rows, device_slots)
        records, kv = self.canary.export_rows(device_slots).cpu(), self.kv(device_slots).cpu()
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


PATHS = [pytest.param("cpu", False, id="cpu-ops"),
         pytest.param("cpu", None, id="cpu-default"),
         pytest.param("cuda", None, id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
             not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device,fused", PATHS)
def test_rows_an_engine_moves_in_its_own_copy_land_and_are_verified_at_once(device, fused):
    """An engine copies the canary's rows (``row_pairs``) with its K/V to host rows and back, then
    calls ``rows_landed``: the host rows hold what ``export_rows`` gives, the clean landing reports
    nothing, and a fingerprint word damaged on the host is FINGERPRINT at SWEEP at its slot."""
    c, slots, _ = prefilled(11, device, 300, 64, 12, 256, fused)
    c.attach_host_tier(64)
    gen = torch.Generator().manual_seed(11)
    run = torch.tensor(slots[1][:10], dtype=torch.int64)
    rows = torch.randperm(64, generator=gen)[:10]
    pairs = c.row_pairs()
    assert [(tuple(d.shape), tuple(h.shape)) for d, h in pairs] == [((300, 32), (64, 32)), ((300, 8), (64, 8))]
    for dev, host in pairs:
        host[rows] = dev[run.to(device)].cpu()
    assert torch.equal(c.host_rows[rows], c.export_rows(run).cpu())
    saved = c.host_rows.clone()
    for step, damage in ((1, False), (3, True)):
        c.host_rows.copy_(saved)
        if damage:
            c.host_rows[int(rows[4]), 8 * FINGERPRINT + 1] ^= 0x40
        for dev, host in pairs:  # the device rows overwritten first: what lands must come from the host rows
            dev[run.to(device)] = torch.randint(0, 256, (10, dev.shape[1]), dtype=torch.uint8, generator=gen).to(device)
            dev[run.to(device)] = host[rows].to(device)
        c.rows_landed(run, rows)
        got = [(v.slot, v.point.name, v.reasons) for v in read_all(c, step)]
        assert got == ([(int(run[4]), "SWEEP", Reason.FINGERPRINT)] if damage else [])


def test_rows_landed_and_row_pairs_refuse_before_anything_is_read():
    c, slots, _ = prefilled(12, "cpu", 300, 64, 12, 256)
    with pytest.raises(KVCanaryError, match=r"row_pairs\(\) before attach_host_tier\(\)"):
        c.row_pairs()
    with pytest.raises(KVCanaryError, match=r"rows_landed\(\) before attach_host_tier\(\)"):
        c.rows_landed(torch.tensor([3, 4]), torch.tensor([0, 1]))
    c.attach_host_tier(8)
    before = c.counters()["SWEEP"]["launches"]
    for args, message in (((torch.tensor([3, 300]), torch.tensor([0, 1])),
                           r"rows_landed device_slots\[1\] = 300 out of range \[0, 300\)"),
                          ((torch.tensor([3, 4]), torch.tensor([0, 8])),
                           r"rows_landed host_rows must be in \[0, 8\) \(attach_host_tier num_rows\)"),
                          ((torch.tensor([3, 4]), torch.tensor([0])),
                           r"rows_landed device_slots length 2 != host_rows length 1")):
        with pytest.raises(KVCanaryError, match=message):
            c.rows_landed(*args)
    assert c.counters()["SWEEP"]["launches"] == before  # nothing verified


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_pool_moves_records_only_after_the_canarys_side_stream_work_is_joined():
    """A forward that raised before its TAIL joined leaves side-stream work behind; the pool's next
    copy of the records (``before_move``) orders the engine's stream after it first."""
    from kvcanary.config import Overlap

    setup = small_setup(num_requests=48, engine={"device": "cuda"}, overlap=Overlap.ALWAYS)
    hooks = RoundTripHooks(setup.canary)
    engine = Engine(setup.model, setup.engine, hooks)
    canary = hooks.attach(engine)
    assert canary.side is not None
    slots, rows = torch.arange(8, 16), torch.arange(8)
    canary.route.fork()  # side work left unjoined, as after a HEAD forked by a forward that raised
    assert canary.route.side_busy
    engine.pool.copy_to_host(slots, rows)
    assert not canary.route.side_busy
    assert torch.equal(canary.host_rows[rows], canary.export_rows(slots).cpu())
