"""export_host_rows (records of offloaded slots into the host rows): kernel, torch path and
reference agree byte for byte on random rows, repeated host rows included; bad arguments are
refused by name before any host row is written."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcanary.errors import InputError, InputTypeError
from kvcanary.ops._common import HAS_TRITON, Backend
from kvcanary.ops.host_rows import export_host_rows

from . import reference as ref
from ._compare import assert_same
from ._helpers import BACKEND_IDS, BACKENDS, INT64_MAX, INT64_MIN, SEEDS, device_for


def _inputs(seed: int, num_slots: int, num_rows: int, n: int, distinct: bool):
    gen = torch.Generator().manual_seed(seed)
    records = torch.randint(0, 256, (num_slots, 32), dtype=torch.uint8, generator=gen)
    tags = torch.randint(INT64_MIN, INT64_MAX, (num_slots,), generator=gen)
    slots = torch.randint(0, num_slots, (n,), generator=gen)
    rows = (torch.randperm(num_rows, generator=gen)[:n] if distinct
            else torch.randint(0, num_rows, (n,), generator=gen))
    host = torch.randint(0, 256, (num_rows, 40), dtype=torch.uint8, generator=gen)
    return records, tags, slots, rows, host


def _run(backend: Backend, records, tags, slots, rows, host) -> torch.Tensor:
    if backend is Backend.TRITON and not HAS_TRITON:
        pytest.skip("triton is not installed")
    dev = device_for(backend)
    out = host.clone()
    if dev.type == "cuda":
        out, slots, rows = out.pin_memory(), slots.pin_memory(), rows.pin_memory()
    export_host_rows(records=records.to(dev), source_tags=tags.to(dev), slots=slots, rows=rows, host=out,
                     backend=backend)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@given(seed=SEEDS, num_slots=st.integers(1, 300), num_rows=st.integers(1, 300), n=st.integers(0, 600),
       distinct=st.booleans())
def test_matches_reference(backend, seed, num_slots, num_rows, n, distinct):
    n = min(n, num_rows) if distinct else n
    records, tags, slots, rows, host = _inputs(seed, num_slots, num_rows, n, distinct)
    want = ref.export_host_rows(records.tolist(), tags.tolist(), slots.tolist(), rows.tolist(), host.tolist())
    got = _run(backend, records, tags, slots, rows, host)
    assert_same(f"host rows [{backend.value}]", got, torch.tensor(want, dtype=torch.uint8))


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_a_repeated_row_holds_its_last_entry(backend):
    records, tags, _, _, host = _inputs(7, 16, 4, 0, True)
    slots, rows = torch.tensor([3, 9, 5, 12]), torch.tensor([2, 2, 0, 2])
    got = _run(backend, records, tags, slots, rows, host)
    side = tags.view(torch.uint8).view(-1, 8)
    assert_same("row 2", got[2], torch.cat([records[12], side[12]]))
    assert_same("row 0", got[0], torch.cat([records[5], side[5]]))
    assert_same("rows 1 and 3 untouched", got[[1, 3]], host[[1, 3]])


@pytest.mark.parametrize(("change", "exc", "message"), [
    (lambda a: a.update(slots=torch.tensor([0, 16, 1])), InputError, r"slots\[1\] = 16 out of range \[0, 16\)"),
    (lambda a: a.update(slots=torch.tensor([0, -1, 1])), InputError, r"slots\[1\] = -1 out of range \[0, 16\)"),
    (lambda a: a.update(rows=torch.tensor([0, 1, 4])), InputError, r"rows\[2\] = 4 out of range \[0, 4\)"),
    (lambda a: a.update(rows=torch.tensor([0, 1])), InputError, r"rows length 2 != len\(slots\) \(3\)"),
    (lambda a: a.update(rows=torch.tensor([0, 1, 2], dtype=torch.int32)), InputTypeError, "rows dtype int32 != int64"),
    (lambda a: a.update(host=torch.zeros(4, 32, dtype=torch.uint8)), InputError, r"host must be uint8\[num_rows, 40\]"),
    (lambda a: a.update(source_tags=a["source_tags"][:15]), InputError,
     r"source_tags length 15 != records rows \(16\)"),
])
def test_bad_arguments_are_refused_before_any_write(change, exc, message):
    records, tags, _, _, host = _inputs(3, 16, 4, 0, True)
    args = dict(records=records, source_tags=tags, slots=torch.tensor([0, 5, 1]), rows=torch.tensor([0, 1, 2]),
                host=host.clone())
    change(args)
    before = args["host"].clone()
    with pytest.raises(exc, match=message):
        export_host_rows(**args, backend=Backend.TORCH)
    assert torch.equal(args["host"], before)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_the_bound_launch_matches_reference():
    """``launch_export`` with its leading arguments keyed once (a Canary's offloads), call after
    call into the same host rows, repeated rows included."""
    from kvcanary.ops.host_rows import export_fixed, launch_export

    dev = device_for(Backend.TRITON)
    records, tags, _, _, host = _inputs(11, 64, 32, 0, True)
    want = host.tolist()
    out = host.clone().pin_memory() if dev.type == "cuda" else host.clone()
    rec_d, tags_d = records.to(dev), tags.to(dev)
    fixed = export_fixed(rec_d, tags_d, out)
    gen = torch.Generator().manual_seed(5)
    for n in (1, 7, 40, 3):
        slots, rows = torch.randint(0, 64, (n,), generator=gen), torch.randint(0, 32, (n,), generator=gen)
        want = ref.export_host_rows(records.tolist(), tags.tolist(), slots.tolist(), rows.tolist(), want)
        if dev.type == "cuda":
            slots, rows = slots.pin_memory(), rows.pin_memory()
        launch_export(rec_d, tags_d, slots, rows, out, True, fixed)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    assert_same("host rows", out, torch.tensor(want, dtype=torch.uint8))
