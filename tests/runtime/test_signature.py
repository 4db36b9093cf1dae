"""Rows moved between canaries carry the sender's layout signature: a receiver whose layout differs
in any one field refuses them before anything is written, naming both values; the matching twin
lands them and verifies them clean."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcanary import (
    Canary,
    CanaryConfig,
    FingerprintMode,
    ForwardBatch,
    Half,
    HostMirror,
    KVSource,
    LayoutSignature,
    PoolGeometry,
)
from kvcanary.core.record import RECORD_VERSION, Reason
from kvcanary.errors import KVCanaryError

from ._helpers import read_all

NUM_SLOTS, NUM_LAYERS, CTX = 96, 4, 32
LAYOUT = dict(layers=(0, 3), halves=(Half.K, Half.V), real_kv=FingerprintMode.PARTIAL, page_size=4,
              kv_dtype=torch.bfloat16, num_kv_heads=2, head_dim=16, model="llama-3.1-8b@5206a32")
CONFIG_FIELDS = ("layers", "halves", "real_kv")
# field -> (the receiver's value, the field's name in the signature, sender and receiver as the error shows them)
MISMATCHES = {
    "layers": ((0, 2), "layers", "(0, 0, 3, 3)", "(0, 0, 2, 2)"),
    "halves": ((Half.V, Half.K), "halves", "(K, V, K, V)", "(V, K, V, K)"),
    "page_size": (8, "page_size", "4", "8"),
    "kv_dtype": (torch.float16, "dtype", "'bfloat16'", "'float16'"),
    "num_kv_heads": (1, "num_kv_heads", "2", "1"),
    "head_dim": (32, "head_dim", "16", "32"),
    "real_kv": (FingerprintMode.ALL, "fingerprint", "PARTIAL", "ALL"),
    "model": (None, "model", "'llama-3.1-8b@5206a32'", "None"),
}
FIELDS = ["record_version", *MISMATCHES]


class Side:
    """One canary over a pool of ``NUM_LAYERS`` layers' K and V (bfloat16 [slots, 2, 16], random),
    whose request in page-table row 1 was prefilled by one forward over random slots and tokens."""

    def __init__(self, seed: int, **layout):
        lay = {**LAYOUT, **layout}
        gen = self.gen = torch.Generator().manual_seed(seed)
        self.k = [torch.randn(NUM_SLOTS, 2, 16, generator=gen).bfloat16() for _ in range(NUM_LAYERS)]
        self.v = [torch.randn(NUM_SLOTS, 2, 16, generator=gen).bfloat16() for _ in range(NUM_LAYERS)]
        bufs = {Half.K: self.k, Half.V: self.v}
        sources = [KVSource.from_buffer(bufs[h][layer], half=h, layer=layer)
                   for layer in lay["layers"] for h in lay["halves"]]
        config = CanaryConfig(real_kv=lay["real_kv"], layers=lay["layers"], halves=lay["halves"], max_bs=2,
                              max_tokens=CTX, sweep_interval=0)
        geometry = PoolGeometry(NUM_SLOTS, 3, CTX, "cpu", **{f: v for f, v in lay.items() if f not in CONFIG_FIELDS})
        self.canary = Canary(config, geometry, sources=sources)
        n = 20
        self.slots = (torch.randperm(NUM_SLOTS - 1, generator=gen)[:n] + 1).tolist()
        self.tokens = torch.randint(0, 30_000, (n,), generator=gen).tolist()
        table = torch.zeros(3, CTX, dtype=torch.int32)
        table[1, :n] = torch.tensor(self.slots, dtype=torch.int32)
        i64 = lambda v: torch.tensor(v, dtype=torch.int64)
        batch = ForwardBatch(i64([1]), i64([0]), i64([n]), table, i64(self.tokens), i64(list(range(n))),
                             i64(self.slots))
        with self.canary.forward(batch):
            for buf in self.k + self.v:
                buf[batch.out_cache_loc] = torch.randn(n, 2, 16, generator=gen).bfloat16()
        assert self.canary.end_step(0).violations == []

    def state(self) -> list[torch.Tensor]:
        return [self.canary.state.records.clone(), self.canary.state.source_tags.clone()]

    def free_slots(self, n: int) -> torch.Tensor:
        free = [s for s in range(1, NUM_SLOTS) if s not in self.slots]
        return torch.tensor(free[:n], dtype=torch.int64)

    def copy_kv(self, src: Side, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        for mine, theirs in ((self.k, src.k), (self.v, src.v)):
            for layer in range(NUM_LAYERS):
                mine[layer][dst_slots] = theirs[layer][src_slots]


def _pair(field: str) -> tuple[Side, Side, LayoutSignature]:
    """A sender and a receiver differing in ``field`` only, and the signature the rows travel with."""
    sender = Side(1)
    if field == "record_version":  # a sender of another record layout: its rows say so
        receiver = Side(2)
        return sender, receiver, dataclasses.replace(sender.canary.signature, record_version=RECORD_VERSION + 1)
    receiver = Side(2, **{field: MISMATCHES[field][0]})
    return sender, receiver, sender.canary.signature


def _message(op: str, field: str) -> str:
    if field == "record_version":
        return f"{op}: signature mismatch: record_version sender {RECORD_VERSION + 1} receiver {RECORD_VERSION} ("
    _, name, sent, got = MISMATCHES[field]
    return f"{op}: signature mismatch: {name} sender {sent} receiver {got} ("


@pytest.mark.parametrize("op", ["import_rows", "land_rows"])
@pytest.mark.parametrize("field", FIELDS)
def test_import_refuses_rows_of_another_layout_before_writing(op, field):
    sender, receiver, signature = _pair(field)
    src = torch.tensor(sender.slots, dtype=torch.int64)
    rows, dst = sender.canary.export_rows(src), receiver.free_slots(len(src))
    receiver.copy_kv(sender, src, dst)
    before, launches = receiver.state(), receiver.canary.counters()["SWEEP"]["launches"]
    with pytest.raises(KVCanaryError) as err:
        getattr(receiver.canary, op)(dst, rows, signature)
    assert str(err.value).startswith(_message(op, field)), str(err.value)
    assert str(err.value).count(" sender ") == 1  # exactly the one field that differs
    for a, b in zip(before, receiver.state(), strict=True):
        assert torch.equal(a, b), "a refused import wrote records"
    receiver.canary.flush(1)
    assert receiver.canary.counters()["SWEEP"]["launches"] == launches  # nothing verified either


def test_import_of_the_same_layout_lands_and_verifies_clean_and_a_damaged_twin_is_caught():
    sender, receiver = Side(1), Side(2)
    assert sender.canary.signature == receiver.canary.signature
    assert sender.canary.signature == LayoutSignature(RECORD_VERSION, (0, 0, 3, 3), (Half.K, Half.V, Half.K, Half.V),
                                                      4, "bfloat16", 2, 16, FingerprintMode.PARTIAL,
                                                      "llama-3.1-8b@5206a32")
    src = torch.tensor(sender.slots, dtype=torch.int64)
    rows = sender.canary.export_rows(src)
    free = receiver.free_slots(2 * len(src))
    for step, damage in ((1, False), (3, True)):
        dst = free[len(src):] if damage else free[: len(src)]
        receiver.copy_kv(sender, src, dst)
        if damage:
            receiver.k[3][int(dst[7]), 0, 0] += 1.0  # a covered source's bytes differ from the record's
        checked = receiver.canary.counters()["SWEEP"]["checked"]
        receiver.canary.import_rows(dst, rows, sender.canary.signature)
        got = [(v.slot, v.point.name, v.reasons) for v in read_all(receiver.canary, step)]
        assert torch.equal(receiver.canary.export_rows(dst), rows)
        assert receiver.canary.counters()["SWEEP"]["checked"] - checked == len(src)
        assert got == ([(int(dst[7]), "SWEEP", Reason.FINGERPRINT)] if damage else [])


def test_import_without_a_signature_is_refused_naming_what_to_pass():
    sender, receiver = Side(1), Side(2)
    rows = sender.canary.export_rows(torch.tensor(sender.slots))
    before = receiver.state()
    for bad in (None, sender.canary.signature.__dict__):
        with pytest.raises(KVCanaryError, match=r"import_rows signature must be the sender's LayoutSignature "
                                                r"\(its canary.signature, shipped with the rows\), got "):
            receiver.canary.import_rows(receiver.free_slots(len(rows)), rows, bad)
    assert all(torch.equal(a, b) for a, b in zip(before, receiver.state(), strict=True))


def test_every_differing_field_is_named_at_once():
    receiver = Side(2, page_size=8, model="other")
    with pytest.raises(KVCanaryError, match=r"page_size sender 4 receiver 8; model sender 'llama-3.1-8b@5206a32' "
                                            r"receiver 'other'"):
        receiver.canary.signature.check("import_rows", Side(1).canary.signature)


@pytest.mark.parametrize("field", FIELDS)
def test_a_host_mirror_of_another_layout_is_not_adopted(field):
    """A host tier shared by pools, or one that outlives its canary: its mirror carries the signature
    of the canary that made it, and another canary adopts it only with an equal one."""
    sender, receiver, signature = _pair(field)
    sender.canary.attach_host_tier(24)
    src = torch.tensor(sender.slots, dtype=torch.int64)
    sender.canary.offload(src, torch.arange(len(src)))
    mirror = HostMirror(sender.canary.host_rows, signature)
    before = receiver.state()
    with pytest.raises(KVCanaryError) as err:
        receiver.canary.attach_host_tier(mirror)
    assert str(err.value).startswith(_message("attach_host_tier", field)), str(err.value)
    assert receiver.canary.host_mirror is None and receiver.canary.host_rows is None
    assert all(torch.equal(a, b) for a, b in zip(before, receiver.state(), strict=True))
    with pytest.raises(KVCanaryError, match=r"load_back\(\) before attach_host_tier\(\)"):
        receiver.canary.load_back(torch.arange(len(src)), receiver.free_slots(len(src)))


def test_a_host_mirror_of_the_same_layout_is_adopted_and_its_rows_load_back_clean():
    sender, receiver = Side(1), Side(2)
    sender.canary.attach_host_tier(24)
    assert sender.canary.host_mirror.signature is sender.canary.signature
    src, host = torch.tensor(sender.slots, dtype=torch.int64), torch.arange(3, 23)
    sender.canary.offload(src, host)
    receiver.canary.attach_host_tier(sender.canary.host_mirror)
    assert receiver.canary.host_rows is sender.canary.host_rows  # shared, not copied
    dst = receiver.free_slots(len(src))
    receiver.copy_kv(sender, src, dst)
    receiver.canary.load_back(host, dst)
    assert read_all(receiver.canary, 1) == []
    assert receiver.canary.counters()["SWEEP"]["checked"] == len(src)
    assert torch.equal(receiver.canary.export_rows(dst), sender.canary.export_rows(src))
    bad = HostMirror(torch.zeros(4, 32, dtype=torch.uint8), sender.canary.signature)
    with pytest.raises(KVCanaryError, match=r"attach_host_tier mirror.rows must be a contiguous uint8\[num_rows, 40\] "
                                            r"tensor on the host, got torch.uint8\[4, 32\] on cpu"):
        receiver.canary.attach_host_tier(bad)
    assert receiver.canary.host_rows is sender.canary.host_rows


def test_pool_geometry_refuses_bad_layout_fields():
    from kvcanary.errors import ConfigError

    for kwargs, message in (({"page_size": 0}, r"PoolGeometry.page_size must be an int >= 1 or None, got 0"),
                            ({"head_dim": 2.0}, r"PoolGeometry.head_dim must be an int >= 1 or None, got 2.0"),
                            ({"kv_dtype": 3}, r"PoolGeometry.kv_dtype must be a torch.dtype, its name or None, got 3"),
                            ({"model": 7}, r"PoolGeometry.model must be a str or None, got 7")):
        with pytest.raises(ConfigError, match=message):
            PoolGeometry(8, 2, 4, **kwargs)
