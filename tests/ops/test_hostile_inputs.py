"""The inputs that once drove kernels out of bounds, hung them or raised raw torch errors: each
is now refused on both backends with an error naming the argument, before anything is written."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcanary.core.record import new_ring, new_stats
from kvcanary.errors import InputError, InputTypeError
from kvcanary.ops.check import check_forward
from kvcanary.ops.fingerprint import FingerprintMode, KVSource, fingerprint, source_meta
from kvcanary.ops.plan import Plan, build_plan
from kvcanary.ops.state import DeviceState
from kvcanary.ops.verify import verify

from ._helpers import WITH_NUMBA, WITH_NUMBA_IDS, device_for, random_canary

i64 = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731


def state(num_slots: int = 16) -> DeviceState:
    ring, counter = new_ring(8)
    return DeviceState(random_canary(torch.Generator().manual_seed(2), num_slots), ring, counter, new_stats())


def batch(prefix=(2, 1), extend=(1, 1), max_ctx: int = 6) -> dict:
    rtt = torch.arange(1, 1 + 3 * max_ctx, dtype=torch.int32).view(3, max_ctx) % 15 + 1
    n = sum(extend)
    return dict(req_pool_indices=i64(1, 2), prefix_lens=i64(*prefix), extend_lens=i64(*extend), req_to_token=rtt,
                input_ids=torch.arange(5, 5 + n), positions=i64(*[p + j for p, e in zip(prefix, extend, strict=True)
                                                                   for j in range(e)]),
                out_cache_loc=i64(*range(1, 1 + n)))


def unchanged(s: DeviceState, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip((s.records, s.ring, s.ring_counter, s.stats, s.error), before,
                                                    strict=True))


def snap(s: DeviceState) -> list[torch.Tensor]:
    return [t.clone() for t in (s.records, s.ring, s.ring_counter, s.stats, s.error)]


@pytest.mark.parametrize("backend", WITH_NUMBA, ids=WITH_NUMBA_IDS)
@pytest.mark.parametrize(("change", "fragment"), [
    (dict(prefix_lens=i64(2**63 - 1, 1)), r"prefix_lens\[0\] out of range"),
    (dict(extend_lens=i64(2**63 - 1, 1)), r"prefix_lens \+ extend_lens\[0\] out of range"),
    (dict(req_to_token=torch.zeros(3, 0, dtype=torch.int32)), r"req_to_token shape \(3, 0\) must have at least"),
    (dict(req_to_token=torch.zeros(0, 6, dtype=torch.int32)), r"req_to_token shape \(0, 6\) must have at least"),
    (dict(req_to_token=torch.zeros(1, 6, dtype=torch.int32).expand(3, 6)), "non-overlapping rows"),
    (dict(input_ids=torch.arange(10)[::5]), "input_ids must be contiguous"),
    (dict(split=10**12), r"split 1000000000000 out of range \[1, 1024\]"),
    (dict(window="2"), "window must be an int, got str"),
    (dict(tag=12), r"tag 12 out of range \[0, 12\)"),
    (dict(tag=1.0), "tag must be an int"),
])
def test_check_forward_refuses(backend, change, fragment):
    s = state()
    before = snap(s)
    kw = batch() | change
    if "extend_lens" in change or "prefix_lens" in change:
        kw["input_ids"] = kw["positions"] = kw["out_cache_loc"] = i64(1, 2)
    with pytest.raises(InputError, match=fragment):
        check_forward(state=s, **{"tag": 0, "stamp": True, **kw}, backend=backend)
    assert unchanged(s, before)


@pytest.mark.parametrize("backend", WITH_NUMBA, ids=WITH_NUMBA_IDS)
def test_a_negative_or_empty_ring_counter_and_a_strided_stats_never_reach_a_kernel(backend):
    s = state()
    s.ring_counter.fill_(-1)
    before = snap(s)
    with pytest.raises(InputError, match="state.ring_counter -1 < 0"):
        check_forward(state=s, **batch(), tag=0, stamp=True, backend=backend)
    assert unchanged(s, before)
    ring, _ = new_ring(4)
    with pytest.raises(InputError, match=r"state.ring_counter must be int64\[1\], got shape \(0,\)"):
        DeviceState(s.records.clone(), ring, torch.zeros(0, dtype=torch.int64), new_stats())
    with pytest.raises(InputError, match="state.stats must be contiguous"):
        DeviceState(s.records.clone(), ring, torch.zeros(1, dtype=torch.int64),
                     torch.zeros(3, 12, dtype=torch.int64).t())


@pytest.mark.parametrize("backend", WITH_NUMBA, ids=WITH_NUMBA_IDS)
def test_a_ring_counter_near_2_63_drops_rows_instead_of_writing_before_the_ring(backend):
    dev = device_for(backend)
    buf = torch.full((12, 8), -5, dtype=torch.int64, device=dev)
    s = DeviceState(random_canary(torch.Generator().manual_seed(3), 16).to(dev), buf[2:10],
                    torch.tensor([2**63 - 2], device=dev), new_stats(dev))
    plan = Plan.allocate(4, 1, dev)
    plan.slot.fill_(99)  # wild: every entry is a violation
    plan.count.fill_(4)
    plan.enable.fill_(1)
    verify(state=s, plan=plan, tag=0, backend=backend)
    assert torch.equal(buf.cpu(), torch.full((12, 8), -5)), "a row landed outside the ring's rows"


def test_hand_built_plans_of_bad_layout_are_refused_when_built():
    good = Plan.allocate(4, 2)
    fields = {f.name: getattr(good, f.name) for f in dataclasses.fields(good)}
    with pytest.raises(InputError, match="Plan.slot must be contiguous"):
        Plan(**fields | dict(slot=torch.zeros(8, dtype=torch.int32)[::2]))
    with pytest.raises(InputError, match=r"Plan.pred length 3 != 4 \(capacity 4, max_bs 2\)"):
        Plan(**fields | dict(pred=torch.zeros(3, dtype=torch.int32)))
    with pytest.raises(InputError, match="Plan capacity 0 and max_bs 2 must be >= 1"):
        Plan(**fields | {k: torch.zeros(0, dtype=fields[k].dtype) for k in ("slot", "pred", "position", "token")})
    with pytest.raises(InputError, match=r"Plan.write_offsets length 2 != 3"):
        Plan(**fields | dict(write_offsets=torch.zeros(2, dtype=torch.int64)))
    with pytest.raises(InputTypeError, match="Plan.count dtype int32 != int64"):
        Plan(**fields | dict(count=torch.zeros(1, dtype=torch.int32)))


@pytest.mark.parametrize("backend", WITH_NUMBA, ids=WITH_NUMBA_IDS)
def test_a_plan_resized_after_it_was_built_is_refused(backend):
    plan = Plan.allocate(4, 2)
    plan.slot.resize_(2)
    with pytest.raises(InputError, match="plan buffers were resized"):
        verify(state=state(), plan=plan, tag=0, backend=backend)
    with pytest.raises(InputError, match="plan buffers were resized"):
        build_plan(**{k: v for k, v in batch().items() if k in ("req_pool_indices", "prefix_lens", "extend_lens",
                                                                    "req_to_token")}, plan=plan, backend=backend)


@pytest.mark.parametrize("backend", WITH_NUMBA, ids=WITH_NUMBA_IDS)
def test_a_meta_table_that_does_not_describe_the_sources_is_refused(backend):
    words = torch.randint(-(2**31), 2**31 - 1, (16 * 8,), dtype=torch.int32)
    src = KVSource(words, 16, 32)
    s = state()
    before = snap(s)
    bad = source_meta([src], FingerprintMode.ALL, "cpu")
    bad[0, 3] = 10**6  # words_read far past the row: the kernel would have read past the source
    with pytest.raises(InputError, match="meta .* != source_meta"):
        fingerprint(slots=i64(1, 2), sources=[src], mode=FingerprintMode.ALL, state=s, record=True, meta=bad,
                    backend=backend)
    with pytest.raises(InputError, match=r"meta must be a contiguous int64\[4, 4\]"):
        verify(state=s, plan=Plan.allocate(4, 1), tag=0, sources=[src], mode=FingerprintMode.ALL,
               meta=torch.zeros(4, 8, dtype=torch.int64)[:, :4], backend=backend)
    assert unchanged(s, before)

