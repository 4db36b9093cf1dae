"""A CPU Canary's per-forward path (``runtime.cpu_forward``): the truth scatter, HEAD, TAIL and
sweeps as one bound compiled call each. It leaves the bytes the ops leave (records, side words,
ring rows, counters, the marks in the K/V sources), with and without damage; it takes no op's
path for a clean batch; and a batch the ops refuse (values refilled in place since the batch
was built, a non-contiguous tensor) gets the ops' own error, before anything is written."""

from __future__ import annotations

import pytest
import torch

import kvcanary.runtime.forward as forward_mod
import kvcanary.runtime.sweeping as sweeping_mod
from kvcanary.config import CanaryConfig
from kvcanary.core.record import Half
from kvcanary.ops.backend import Backend, cpu_kernels_usable
from kvcanary.ops.fingerprint import FingerprintMode, KVSource
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.canary import Canary, PoolGeometry
from kvcanary.runtime.sweep import SweepRun

pytestmark = pytest.mark.skipif(not cpu_kernels_usable(), reason="numba does not serve here")

NUM_SLOTS, ROWS, MAX_CTX = 96, 6, 24


def _canary(path: str, seed: int) -> tuple[Canary, list[torch.Tensor]]:
    """A canary over K/V buffers of two layers; ``path``: "bound" (the default on the CPU), "op"
    (the same kernel through check_forward) or "torch" (the ops one by one)."""
    gen = torch.Generator().manual_seed(seed)
    buffers = [torch.randn(NUM_SLOTS, 2, 8, dtype=torch.float64, generator=gen) for _ in range(2)]
    sources = [KVSource.from_buffer(b, half=h, layer=i) for i, b in enumerate(buffers) for h in (Half.K,)]
    config = CanaryConfig(fused=False if path == "torch" else None, real_kv=FingerprintMode.PARTIAL, max_bs=4,
                          max_tokens=64)
    canary = Canary(config, PoolGeometry(NUM_SLOTS, ROWS, MAX_CTX), sources=sources)
    if path == "op":
        canary.cpu.bound = None  # every batch refused: the op's path
    return canary, buffers


def _steps(seed: int, appends: bool = False) -> list[ForwardBatch]:
    """A prefill of three requests (two share a 6-token prefix, as a radix hit gives), then decodes;
    ``appends``: the decodes hand their truth as appends (each request's one new token at its
    prefix length; the prefill sent every history whole)."""
    gen = torch.Generator().manual_seed(seed)
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)
    rtt = torch.zeros(ROWS, MAX_CTX, dtype=torch.int32)
    slots = (torch.randperm(NUM_SLOTS - 1, generator=gen) + 1).tolist()
    tokens = {r: torch.randint(0, 1000, (MAX_CTX,), generator=gen).tolist() for r in (1, 2, 3)}
    tokens[2][:6] = tokens[1][:6]
    lens = {1: 9, 2: 6, 3: 5}
    rtt[1, :9] = torch.tensor(slots[:9], dtype=torch.int32)
    rtt[3, :5] = torch.tensor(slots[9:14], dtype=torch.int32)
    free = slots[14:]
    steps = [ForwardBatch(i64([1, 3]), i64([0, 0]), i64([9, 5]), rtt.clone(), i64(tokens[1][:9] + tokens[3][:5]),
                          i64(list(range(9)) + list(range(5))), i64(rtt[1, :9].tolist() + rtt[3, :5].tolist()),
                          truth_ids=i64(tokens[1][:9] + tokens[3][:5]), truth_offsets=i64([0, 9, 14]))]
    rtt[2, :6] = rtt[1, :6]  # request 2 reads request 1's first 6 slots
    for _ in range(4):
        rows = [1, 2, 3]
        loc = []
        for r in rows:
            rtt[r, lens[r]] = free.pop()
            loc.append(int(rtt[r, lens[r]]))
        prefix = [lens[r] for r in rows]
        truth = [t for r in rows for t in tokens[r][: lens[r] + 1]]
        offsets = [0]
        for r in rows:
            offsets.append(offsets[-1] + lens[r] + 1)
        if appends and len(steps) > 1:  # request 2's row holds its history from the first decode on
            truth, offsets, starts = [tokens[r][lens[r]] for r in rows], [0, 1, 2, 3], i64(prefix)
        else:
            starts = None
        steps.append(ForwardBatch(i64(rows), i64(prefix), i64([1, 1, 1]), rtt.clone(),
                                  i64([tokens[r][lens[r]] for r in rows]), i64(prefix), i64(loc),
                                  truth_ids=i64(truth), truth_offsets=i64(offsets), truth_starts=starts))
        for r in rows:
            lens[r] += 1
    return steps


def _run(path: str, seed: int, damage: bool, appends: bool = False) -> tuple[Canary, list]:
    canary, buffers = _canary(path, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    steps = _steps(seed, appends)
    for step, b in enumerate(steps):
        canary.head(b)
        hit = damage and step == 2
        for i, buf in enumerate(buffers):  # the model writes every target's K/V (HEAD's marks go) ...
            loc = b.out_cache_loc[1:] if hit and i == 0 else b.out_cache_loc  # ... but one, when damaged
            buf[loc] = torch.randn(loc.numel(), 2, 8, dtype=torch.float64, generator=gen)
        if hit:  # a stray write into a slot two requests share, a stamp rewritten during the forward
            buffers[1][int(b.req_to_token[2, 3])] += 1.0
            canary.state.records[int(b.req_to_token[3, 1]), 0] ^= 1
        canary.tail(b)
        canary.end_step(step)
        if step == 1:
            runs = [SweepRun(b.req_to_token[1, :4].to(torch.int64), None, 0, -1)]
            canary.sweep(runs)
    return canary, buffers


def _state(canary: Canary, buffers) -> list[torch.Tensor]:
    st = canary.state
    return [st.records, st.source_tags, st.ring[: int(st.ring_counter[0])], st.ring_counter, st.stats, *buffers]


@pytest.mark.parametrize("appends", [False, True], ids=["whole", "appends"])
@pytest.mark.parametrize("damage", [False, True], ids=["clean", "damaged"])
def test_the_bound_path_leaves_the_bytes_of_the_ops(damage, appends):
    bound, bound_kv = _run("bound", 5, damage, appends)
    assert bound.backend is Backend.NUMBA and bound.cpu is not None
    rows = int(bound.state.ring_counter[0])
    assert (rows > 0) == damage, rows
    for path in ("op", "torch"):
        other, other_kv = _run(path, 5, damage, appends)
        mine, theirs = (_state(c, kv) + [c.truth, c.truth_lens] for c, kv in ((bound, bound_kv), (other, other_kv)))
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            assert a.equal(b), f"{path}: buffer {i} differs"
    if appends:  # the appends left the truth whole histories leave
        whole, _ = _run("bound", 5, damage, False)
        assert bound.truth.equal(whole.truth) and bound.truth_lens.equal(whole.truth_lens)


@pytest.mark.parametrize("appends", [False, True], ids=["whole", "appends"])
def test_a_clean_batch_takes_no_op(monkeypatch, appends):
    def refuse(*args, **kwargs):
        raise AssertionError("the op's path was taken")

    for module, name in ((forward_mod, "check_forward"), (forward_mod, "scatter_req_token_ids"),
                         (sweeping_mod, "verify")):
        monkeypatch.setattr(module, name, refuse)
    canary, _ = _run("bound", 3, damage=False, appends=appends)
    assert canary.totals.forwards == 5 and int(canary.state.stats[:, 0].sum()) == 11  # HEAD, TAIL x5, one sweep


def _fresh() -> tuple[Canary, ForwardBatch]:
    canary, _ = _canary("bound", 7)
    return canary, _steps(7)[0]


@pytest.mark.parametrize(("refill", "fragment"), [
    # a row refilled after prepare_head: the truth scatter left to HEAD's call refuses it first
    (lambda b: b.req_pool_indices.__setitem__(1, 9), r"req_pool_indices\[1\] = 9 out of range \[0, 6\)"),
    (lambda b: b.extend_lens.__setitem__(0, 8), r"extend_lens sum 13 != len\(input_ids\) \(14\)"),
    (lambda b: b.prefix_lens.__setitem__(0, -1), r"prefix_lens\[0\] out of range"),
])
def test_values_refilled_after_the_batch_was_built_get_the_ops_error(refill, fragment):
    canary, b = _fresh()
    canary.prepare_head(b)
    before = [t.clone() for t in _state(canary, [])]
    refill(b)
    with pytest.raises(ValueError, match=fragment):
        canary.launch_head(b)
    assert all(a.equal(t) for a, t in zip(before, _state(canary, []), strict=True))


def test_truth_offsets_refilled_after_the_batch_was_built_get_the_scatter_error():
    """HEAD's call makes the truth scatter prepare_head left to it: bad offsets raise the
    scatter's error there, before anything is written; the same batch refilled right passes."""
    canary, b = _fresh()
    good = b.truth_offsets[1].item()
    b.truth_offsets[1] = 20  # decreasing at index 2
    before = [t.clone() for t in (canary.truth, canary.truth_lens, *_state(canary, []))]
    with pytest.raises(ValueError, match="offsets decrease at index 2"):
        canary.head(b)
    after = (canary.truth, canary.truth_lens, *_state(canary, []))
    assert all(x.equal(y) for x, y in zip(before, after, strict=True)) and int(canary.state.error[0]) == 0
    b.truth_offsets[1] = good
    canary.head(b)
    assert canary.truth_lens[:2].tolist() == [9, 5] and int(canary.state.ring_counter[0]) == 0


def test_a_non_contiguous_batch_tensor_gets_the_ops_error():
    canary, b = _fresh()
    wide = torch.zeros(2 * b.num_tokens, dtype=torch.int64)
    wide[::2] = b.positions
    strided = ForwardBatch(b.req_pool_indices, b.prefix_lens, b.extend_lens, b.req_to_token, b.input_ids,
                           wide[::2], b.out_cache_loc, truth_ids=b.truth_ids, truth_offsets=b.truth_offsets)
    records = canary.state.records.clone()
    with pytest.raises(ValueError, match="positions must be contiguous"):
        canary.head(strided)
    assert canary.state.records.equal(records)
    canary.head(b)  # the same batch with contiguous tensors passes
    assert int(canary.state.ring_counter[0]) == 0
