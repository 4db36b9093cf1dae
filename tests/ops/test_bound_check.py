"""BoundCheck: ``check_forward`` with a state's own arguments bound once gives the same bytes,
and refuses (launching nothing) every batch whose layout ``check_forward`` would refuse.

On the CPU the launches run under the Triton interpreter; on CUDA (the GPU run) the same tests
take the device branch, whose per-call checks are attribute reads instead of value checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvcanary.core.record import LaunchPoint
from kvcanary.errors import InputError, InputTypeError
from kvcanary.ops._common import Backend
from kvcanary.ops.bound import BoundCheck
from kvcanary.ops.check import check_forward
from kvcanary.ops.fingerprint import FingerprintMode, source_meta
from kvcanary.ops.scatter import _scatter_torch, scatter_req_token_ids
from kvcanary.ops.state import COUNTER_BLOCK_WORDS, DeviceState, Workspace

from ._compare import assert_same, sorted_rows
from ._helpers import INT64_MAX, INT64_MIN, SEEDS, device_for, on_device
from .test_check import MODES, make_world
from .test_publish import reference as publish_reference

DEV = device_for(Backend.TRITON)
BATCH = ("req_pool_indices", "prefix_lens", "extend_lens", "req_to_token", "input_ids", "positions", "out_cache_loc")


def state_of(w: dict, max_bs: int, max_tokens: int) -> DeviceState:
    """A DeviceState on copies of the world's buffers, with a HEAD and a TAIL workspace."""
    spaces = tuple(Workspace.allocate(max_bs, max_tokens, DEV) for _ in (LaunchPoint.HEAD, LaunchPoint.TAIL))
    return DeviceState(*(on_device(w[k], DEV) for k in ("canary", "ring", "ring_counter", "stats")),
                       workspaces=spaces, source_tags=on_device(w["source_tags"], DEV))


def padded_lens(w: dict, max_bs: int, gen: torch.Generator) -> torch.Tensor | None:
    """The world's truth lengths in a buffer of ``max_bs``, random beyond bs (never read)."""
    if w["truth_lens"] is None:
        return None
    bs = w["truth_lens"].shape[0]
    lens = torch.randint(0, 1 << 40, (max_bs,), generator=gen)
    lens[:bs] = w["truth_lens"]
    return lens.to(DEV)


def outputs(state: DeviceState, sources) -> dict:
    """Every buffer a launch may write; the ring's rows sorted (their order is unspecified)."""
    out = dict(records=state.records, counter=state.ring_counter, stats=state.stats, side=state.source_tags)
    out.update({f"source {i}": s.words for i, s in enumerate(sources)})
    out = {k: v.clone() for k, v in out.items()}
    out["ring rows"] = sorted_rows(state.ring)
    return out


@settings(max_examples=8, deadline=None)
@given(seed=SEEDS, lens=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 4)), max_size=4),
       mode=st.sampled_from(MODES), with_truth=st.booleans(), corrupt=st.sampled_from([0.0, 0.2]),
       lut=st.booleans(), stamp=st.booleans(), tag=st.integers(0, 11), counted=st.booleans())
def test_bound_launch_gives_check_forwards_bytes(seed, lens, mode, with_truth, corrupt, lut, stamp, tag, counted):
    """``counted``: the held slots as ``held_words``, a count that stops before random slots after it."""
    gen = torch.Generator().manual_seed(seed)
    w = make_world(gen, [p for p, _ in lens], [e for _, e in lens], mode=mode, with_truth=with_truth,
                   corrupt=corrupt, lut=lut, window=0, stamp=stamp, tag=tag)
    bs, n = w["req_pool_indices"].shape[0], w["input_ids"].shape[0]
    max_bs, max_tokens = bs + int(torch.randint(0, 3, (1,), generator=gen)) + 1, n + 3
    got = {}
    for bound in (False, True):
        state = state_of(w, max_bs, max_tokens)
        sources = on_device(w["sources"], DEV)
        batch = {k: on_device(w[k], DEV) for k in BATCH}
        truth, held = on_device(w["truth"], DEV), on_device(w["held"], DEV) if stamp or counted else None
        words = None
        if counted:
            after = torch.randint(1, state.num_slots, (3,), generator=torch.Generator().manual_seed(seed))
            words, held = torch.cat([torch.tensor([held.shape[0]], device=DEV), held, after.to(DEV)]), None
        lut_t = on_device(w["lut"], DEV)
        if bound:
            check = BoundCheck(state, stamp=stamp, sources=sources, mode=mode, truth=truth,
                               truth_lens=padded_lens(w, max_bs, gen) if with_truth else None)
            assert check(*batch.values(), tag=tag, truth=with_truth, lut=lut_t, held=held, held_words=words) \
                == (stamp or not counted)  # TAIL takes no held slots: check_forward ignores them
            if not stamp and counted:
                check_forward(state=state, **batch, tag=tag, stamp=stamp, truth=truth,
                              truth_lens=on_device(w["truth_lens"], DEV), sources=sources, mode=mode, lut=lut_t,
                              held_words=words, backend=Backend.TRITON)
        else:
            check_forward(state=state, **batch, tag=tag, stamp=stamp, truth=truth,
                          truth_lens=on_device(w["truth_lens"], DEV), sources=sources, mode=mode, lut=lut_t,
                          held=held, held_words=words, backend=Backend.TRITON)
        got[bound] = outputs(state, sources)
        if counted:
            got[bound]["held_words"] = words.clone()
    for name, want in got[False].items():
        assert_same(f"{name} (bound)", got[True][name], want)


def block_state_of(w: dict, max_bs: int, max_tokens: int, gen: torch.Generator) -> DeviceState:
    """``state_of``, its ring counter, stats and error words in one counter block (as
    ``DeviceState.allocate`` lays them out), the error flags drawn at random."""
    state = DeviceState.allocate(w["canary"].shape[0], ring_capacity=w["ring"].shape[0], max_bs=max_bs,
                                 max_tokens=max_tokens, device=DEV)
    for name, key in (("records", "canary"), ("ring", "ring"), ("ring_counter", "ring_counter"), ("stats", "stats"),
                      ("source_tags", "source_tags")):
        getattr(state, name).copy_(w[key])
    state.error.fill_(int(torch.randint(0, 8, (1,), generator=gen)))
    return state


def publication_of(gen: torch.Generator, num_rows: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq, rows) for a counter block: the sequence word at ``start``, rows of random words."""
    rows = torch.randint(INT64_MIN, INT64_MAX, (num_rows, COUNTER_BLOCK_WORDS + 1), generator=gen)
    return (torch.tensor([start], dtype=torch.int64, device=DEV),
            rows.pin_memory() if DEV.type == "cuda" else rows)


@settings(max_examples=6, deadline=None)
@given(seed=SEEDS, lens=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 4)), max_size=4),
       mode=st.sampled_from(MODES), with_truth=st.booleans(), corrupt=st.sampled_from([0.0, 0.2]),
       stamp=st.booleans(), num_rows=st.integers(1, 5), start=st.integers(0, 2**40), publish=st.booleans())
def test_a_publishing_launch_gives_check_forwards_bytes_then_publishes_the_block(seed, lens, mode, with_truth,
                                                                                 corrupt, stamp, num_rows, start,
                                                                                 publish):
    """The launch with ``publish`` leaves what ``check_forward`` (torch path) leaves, and the
    publication's rows and sequence word are those of ``publish_counters`` on the block after it
    (pure-Python reference); without ``publish`` they are untouched."""
    gen = torch.Generator().manual_seed(seed)
    w = make_world(gen, [p for p, _ in lens], [e for _, e in lens], mode=mode, with_truth=with_truth,
                   corrupt=corrupt, lut=False, window=0, stamp=stamp, tag=3)
    bs, n = w["req_pool_indices"].shape[0], w["input_ids"].shape[0]
    got, blocks = {}, {}
    for bound in (False, True):
        g = torch.Generator().manual_seed(seed + 1)  # the same error flags and rows for both
        state = block_state_of(w, bs + 1, n + 1, g)
        seq, rows = publication_of(g, num_rows, start)
        sources = on_device(w["sources"], DEV)
        batch = {k: on_device(w[k], DEV) for k in BATCH}
        truth, held = on_device(w["truth"], DEV), on_device(w["held"], DEV) if stamp else None
        if bound:
            lens_t = torch.zeros(bs + 1, dtype=torch.int64, device=DEV)
            if with_truth:
                lens_t[:bs] = w["truth_lens"].to(DEV)
            check = BoundCheck(state, stamp=stamp, sources=sources, mode=mode, truth=truth if with_truth else None,
                               truth_lens=lens_t if with_truth else None, publication=(seq, rows))
            assert check(*batch.values(), tag=3, truth=with_truth, held=held, publish=publish)
            if DEV.type == "cuda":
                torch.cuda.synchronize()
            got_rows, got_seq = rows.tolist(), int(seq[0])
        else:
            check_forward(state=state, **batch, tag=3, stamp=stamp, truth=truth,
                          truth_lens=on_device(w["truth_lens"], DEV), sources=sources, mode=mode, held=held,
                          backend=Backend.TORCH)
            blocks = [state.counter_block().tolist()] if publish else []
            want_rows, want_seq = publish_reference(blocks, rows.tolist(), start)
        got[bound] = outputs(state, sources)
        got[bound]["error"] = state.error.clone()
    for name, want in got[False].items():
        assert_same(f"{name} (publishing launch)", got[True][name], want)
    assert_same("publication rows", got_rows, want_rows)
    assert got_seq == want_seq


def segments(w: dict, gen: torch.Generator, extra: int, appends: bool) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Each request's token truth, flat, its offsets and its starts: its history (its truth row up
    to its length, then up to ``extra`` random tokens more, some past the table's width) from
    column 0, or (``appends``) from a random column up to its length. Requests on one row (the
    padding row) take slices of one sequence: where two write a column they write one value, so
    the result does not depend on which lands last (unspecified, as for the scatter)."""
    rows, lens = w["req_pool_indices"].tolist(), [max(n, 0) for n in w["truth_lens"].tolist()]
    longest = {row: max(n for r, n in zip(rows, lens, strict=True) if r == row) for row in rows}
    tokens = {row: torch.cat([w["truth"][row, :n].long(), torch.randint(0, 1 << 20, (extra,), generator=gen)])
              for row, n in longest.items()}
    starts = [int(torch.randint(0, n + 1, (1,), generator=gen)) if appends else 0 for n in lens]
    parts = [tokens[row][s: n + int(torch.randint(0, extra + 1, (1,), generator=gen))]
             for row, n, s in zip(rows, lens, starts, strict=True)]
    offsets = torch.tensor([0] + [len(p) for p in parts]).cumsum(0)
    return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)), offsets, starts


@settings(max_examples=16, deadline=None)
@given(seed=SEEDS, lens=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 4)), min_size=1, max_size=4),
       mode=st.sampled_from(MODES), corrupt=st.sampled_from([0.0, 0.2]), lut=st.booleans(),
       window=st.sampled_from([0, 3]), appends=st.booleans(),
       damage=st.sampled_from(["none", "ends", "backwards", "start", "far"]), extra=st.integers(0, 40))
def test_a_head_that_scatters_the_truth_gives_the_scatter_then_check_forwards_bytes(seed, lens, mode, corrupt, lut,
                                                                                   window, appends, damage, extra):
    """HEAD with ``truth_ids`` (whole histories, or with ``truth_starts`` appends: each request's
    truth from a column on, the columns before it kept) leaves what the scatter (torch path) then
    ``check_forward`` (torch path) leave: records, ring, counters, marks' verdicts, the truth
    table, the lengths and the error flags, bad offsets and a negative start included (flagged,
    their requests not written), and a start past the table's width (nothing written)."""
    assume(appends or damage not in ("start", "far"))
    gen = torch.Generator().manual_seed(seed)
    w = make_world(gen, [p for p, _ in lens], [e for _, e in lens], mode=mode, with_truth=True, corrupt=corrupt,
                   lut=lut, window=window, stamp=True, tag=2)
    bs, n = w["req_pool_indices"].shape[0], w["input_ids"].shape[0]
    flat, offsets, starts = segments(w, gen, extra, appends)
    r = int(torch.randint(0, bs, (1,), generator=gen))
    if damage == "ends":
        offsets[-1] += 1
    elif damage == "backwards":
        offsets[r + 1] = offsets[r] - 1
    elif damage == "start":
        starts[r] = -int(torch.randint(1, 1 << 40, (1,), generator=gen))
    elif damage == "far":  # past the table's width: nothing of it written, its length still start + segment
        starts[r] = int(torch.randint(w["truth"].shape[1], 1 << 62, (1,), generator=gen))
    garbage = torch.randint(-5, 1 << 20, w["truth"].shape, generator=gen, dtype=torch.int32)
    # whole histories rewrite every column they read; appends keep the columns before their start: the
    # row's own truth there, garbage past it
    table = torch.where(w["truth"] != 0, w["truth"], garbage) if appends else garbage
    stale_lens = torch.randint(0, 1 << 20, (bs + 1,), generator=gen)
    got = {}
    for fused in (False, True):
        state = state_of(w, bs + 1, n + 1)
        sources = on_device(w["sources"], DEV)
        batch = {k: on_device(w[k], DEV) for k in BATCH}
        truth, truth_lens = table.clone().to(DEV), stale_lens.clone().to(DEV)
        held, lut_t = on_device(w["held"], DEV), on_device(w["lut"], DEV)
        tids, toffs = flat.to(DEV), offsets.to(DEV)
        tstarts = torch.tensor(starts, dtype=torch.int64, device=DEV) if appends else None
        if fused:
            check = BoundCheck(state, stamp=True, sources=sources, mode=mode, window=window, truth=truth,
                               truth_lens=truth_lens)
            assert check(*batch.values(), tag=2, truth=True, lut=lut_t, held=held, truth_ids=tids,
                         truth_offsets=toffs, truth_starts=tstarts)
        else:
            _scatter_torch(tids, toffs, batch["req_pool_indices"], truth, state.error, truth_lens, tstarts)
            check_forward(state=state, **batch, tag=2, stamp=True, truth=truth, truth_lens=truth_lens[:bs],
                          sources=sources, mode=mode, lut=lut_t, window=window, held=held, backend=Backend.TORCH)
        got[fused] = outputs(state, sources) | dict(truth=truth.clone(), lens=truth_lens[:bs].clone(),
                                                    error=state.error.clone())
    for name, want in got[False].items():
        assert_same(f"{name} (HEAD scattering the truth, appends={appends})", got[True][name], want)


def test_truth_histories_go_to_head_with_truth_and_together():
    w = world()
    state = state_of(w, 2, 8)
    batch = {k: on_device(w[k], DEV) for k in BATCH}
    lens = torch.zeros(2, dtype=torch.int64, device=DEV)
    truth = on_device(w["truth"], DEV)
    flat, offsets, _ = segments(w, torch.Generator().manual_seed(1), 0, False)
    head = BoundCheck(state, stamp=True, truth=truth, truth_lens=lens)
    with pytest.raises(InputError, match="truth_ids and truth_offsets go together.*truth_offsets None"):
        head(*batch.values(), tag=0, truth=True, truth_ids=flat.to(DEV))
    with pytest.raises(InputError, match="stamp=False"):
        BoundCheck(state, stamp=False, truth=truth, truth_lens=lens)(*batch.values(), tag=0, truth=True,
                                                                    truth_ids=flat.to(DEV),
                                                                    truth_offsets=offsets.to(DEV))
    with pytest.raises(InputError, match="truth=False"):
        head(*batch.values(), tag=0, truth_ids=flat.to(DEV), truth_offsets=offsets.to(DEV))
    before = truth.clone()  # offsets of another batch size: refused, nothing launched
    assert not head(*batch.values(), tag=0, truth=True, truth_ids=flat.to(DEV), truth_offsets=offsets[:-1].to(DEV))
    assert not head(*batch.values(), tag=0, truth=True, truth_ids=flat.to(DEV, torch.int32),
                    truth_offsets=offsets.to(DEV))
    bs = offsets.shape[0] - 1  # starts of another batch size, or not int64: refused, nothing launched
    assert not head(*batch.values(), tag=0, truth=True, truth_ids=flat.to(DEV), truth_offsets=offsets.to(DEV),
                    truth_starts=torch.zeros(bs + 1, dtype=torch.int64, device=DEV))
    assert not head(*batch.values(), tag=0, truth=True, truth_ids=flat.to(DEV), truth_offsets=offsets.to(DEV),
                    truth_starts=torch.zeros(bs, dtype=torch.int32, device=DEV))
    assert_same("truth after refused calls", truth, before)
    # what the caller runs then names the argument
    with pytest.raises(InputTypeError, match="starts dtype int32 != int64"):
        scatter_req_token_ids(flat_in=flat.to(DEV), offsets=offsets.to(DEV), req_pool_indices=batch["req_pool_indices"],
                              pool_out=truth, starts=torch.zeros(bs, dtype=torch.int32, device=DEV))
    with pytest.raises(InputError, match=r"starts length 3 != bs \(2\)"):
        scatter_req_token_ids(flat_in=flat.to(DEV), offsets=offsets.to(DEV), req_pool_indices=batch["req_pool_indices"],
                              pool_out=truth, starts=torch.zeros(bs + 1, dtype=torch.int64, device=DEV))
    with pytest.raises(InputError, match="truth_starts needs truth_ids and truth_offsets"):
        head(*batch.values(), tag=0, truth=True, truth_starts=torch.zeros(bs, dtype=torch.int64, device=DEV))


def test_publish_needs_a_publication_and_one_the_counter_block_fits():
    w = world()
    gen = torch.Generator().manual_seed(11)
    state = block_state_of(w, 2, 8, gen)
    batch = {k: on_device(w[k], DEV) for k in BATCH}
    seq, rows = publication_of(gen, 3, 0)
    with pytest.raises(InputError, match="publish=True but this BoundCheck has no publication"):
        BoundCheck(state, stamp=False)(*batch.values(), tag=0, publish=True)
    with pytest.raises(InputError, match="publish must be True or False, got 1"):
        BoundCheck(state, stamp=False, publication=(seq, rows))(*batch.values(), tag=0, publish=1)
    with pytest.raises(InputTypeError, match="publication must be a \\(seq, rows\\) tuple or None, got list"):
        BoundCheck(state, stamp=False, publication=[seq, rows])
    with pytest.raises(InputError, match=f"publication rows must be int64\\[K >= 1, {COUNTER_BLOCK_WORDS + 1}\\]"):
        BoundCheck(state, stamp=False, publication=(seq, rows[:, :-1].contiguous()))
    with pytest.raises(InputTypeError, match="publication seq dtype int32 != int64"):
        BoundCheck(state, stamp=False, publication=(seq.to(torch.int32), rows))
    with pytest.raises(InputError, match="publication seq length 2 != one sequence word"):
        BoundCheck(state, stamp=False, publication=(torch.cat([seq, seq]), rows))
    with pytest.raises(InputError, match="this state's lie apart"):
        BoundCheck(state_of(w, 2, 8), stamp=False, publication=(seq, rows))
    before = (int(seq[0]), rows.clone())
    assert BoundCheck(state, stamp=False, publication=(seq, rows))(*batch.values(), tag=0)  # publish=False
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    assert int(seq[0]) == before[0]
    assert_same("rows after a launch without publish", rows, before[1])


def world() -> dict:
    return make_world(torch.Generator().manual_seed(5), [6, 3], [2, 1], mode=FingerprintMode.PARTIAL,
                      with_truth=True, corrupt=0.0, lut=False, window=0, stamp=True, tag=0)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values, every other element of a buffer twice as long (not contiguous)."""
    wide = torch.empty(2 * t.shape[0], dtype=t.dtype, device=t.device)
    wide[::2] = t
    return wide[::2]


REFUSED = {
    "int32 input_ids": lambda b: b | dict(input_ids=b["input_ids"].to(torch.int32)),
    "strided positions": lambda b: b | dict(positions=_strided(b["positions"])),
    "short out_cache_loc": lambda b: b | dict(out_cache_loc=b["out_cache_loc"][:-1]),
    "2-D prefix_lens": lambda b: b | dict(prefix_lens=b["prefix_lens"][:, None]),
    "table with column stride 2": lambda b: b | dict(req_to_token=torch.zeros(
        b["req_to_token"].shape[0], 2 * b["req_to_token"].shape[1], dtype=torch.int32, device=DEV)[:, ::2]),
    "table of other rows than the truth": lambda b: b | dict(req_to_token=b["req_to_token"][:-1]),
    "more requests than the workspace": lambda b: b | {k: torch.cat([b[k], b[k]]) for k in BATCH[:3]},
    "a non-tensor": lambda b: b | dict(extend_lens=[2, 1]),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_batch_it_does_not_take_launches_nothing_and_check_forward_names_it(case):
    w = world()
    state = state_of(w, 2, 8)
    sources = on_device(w["sources"], DEV)
    lens = torch.zeros(2, dtype=torch.int64, device=DEV)
    lens[:] = w["truth_lens"].to(DEV)
    truth = on_device(w["truth"], DEV)
    check = BoundCheck(state, stamp=True, mode=FingerprintMode.PARTIAL, sources=sources, truth=truth, truth_lens=lens)
    batch = REFUSED[case]({k: on_device(w[k], DEV) for k in BATCH})
    before = outputs(state, sources)
    # the device branch's own checks refuse it (on the CPU the value checks behind them would too)
    assert not check._layout_ok(tuple(batch.values()), None, truth=True)
    assert not check(*batch.values(), tag=0, truth=True)
    for name, want in before.items():
        assert_same(f"{name} after a refused call", outputs(state, sources)[name], want)
    with pytest.raises((InputError, InputTypeError)):
        check_forward(state=state, **batch, tag=0, stamp=True, truth=truth, truth_lens=lens[: batch[BATCH[0]].shape[0]]
                      if isinstance(batch[BATCH[0]], torch.Tensor) else lens, sources=sources,
                      mode=FingerprintMode.PARTIAL, backend=Backend.TRITON)


def test_held_slots_must_be_one_contiguous_run():
    """An expanded ``held`` (one element seen n times) would have the kernel read past its storage."""
    w = world()
    state = state_of(w, 2, 8)
    batch = {k: on_device(w[k], DEV) for k in BATCH}
    held = torch.tensor([3], dtype=torch.int64, device=DEV).expand(50)
    check = BoundCheck(state, stamp=True)
    assert not check(*batch.values(), tag=0, held=held)
    with pytest.raises(InputError, match="held must be contiguous"):
        check_forward(state=state, **batch, tag=0, stamp=True, held=held, backend=Backend.TRITON)


def test_a_tag_out_of_range_raises_as_in_check_forward():
    w = world()
    state = state_of(w, 2, 8)
    batch = {k: on_device(w[k], DEV) for k in BATCH}
    with pytest.raises(InputError, match="tag 99 out of range"):
        BoundCheck(state, stamp=False)(*batch.values(), tag=99)


def test_bound_arguments_are_checked_when_bound():
    w = world()
    state = state_of(w, 2, 8)
    sources = on_device(w["sources"], DEV)
    with pytest.raises(InputTypeError, match="mode must be a FingerprintMode"):
        BoundCheck(state, stamp=True, mode="partial")
    with pytest.raises(InputError, match="truth_lens length 1 < the workspace's max_bs"):
        BoundCheck(state, stamp=True, truth=on_device(w["truth"], DEV),
                   truth_lens=torch.zeros(1, dtype=torch.int64, device=DEV))
    with pytest.raises(InputError, match="truth and truth_lens go together"):
        BoundCheck(state, stamp=True, truth=on_device(w["truth"], DEV))
    with pytest.raises(InputError, match="split 0 out of range"):
        BoundCheck(state, stamp=True, split=0)
    with pytest.raises(InputTypeError, match="memo must be a BatchMemo or None, got dict"):
        BoundCheck(state, stamp=True, memo={})
    bare = DeviceState(*(on_device(w[k], DEV) for k in ("canary", "ring", "ring_counter", "stats")))
    with pytest.raises(InputError, match="BoundCheck needs a state with workspaces"):
        BoundCheck(bare, stamp=True)
    wrong = source_meta(sources, FingerprintMode.PARTIAL, DEV)[:3]
    with pytest.raises(InputError, match="meta must be a contiguous int64"):
        BoundCheck(state, stamp=False, sources=sources, mode=FingerprintMode.PARTIAL, meta=wrong)


@pytest.mark.parametrize("arg", ["held", "lut"])
def test_a_non_tensor_held_or_lut_is_refused_and_named(arg):
    w = world()
    state = state_of(w, 2, 8)
    batch = {k: on_device(w[k], DEV) for k in BATCH}
    check = BoundCheck(state, stamp=True)
    assert not check(*batch.values(), tag=0, **{arg: [3, 4]})
    with pytest.raises(InputTypeError, match=f"{arg} must be a torch.Tensor"):
        check_forward(state=state, **batch, tag=0, stamp=True, **{arg: [3, 4]}, backend=Backend.TRITON)


def _memo_batch(gen: torch.Generator, device) -> tuple:
    bs, n = 3, 7
    i64 = lambda k: torch.randint(0, 50, (k,), generator=gen).to(device)  # noqa: E731
    table = torch.randint(0, 50, (4, 16), generator=gen, dtype=torch.int32).to(device)
    return i64(bs), i64(bs), i64(bs), table, i64(n), i64(n), i64(n)


def _addresses(batch: tuple, lut) -> list:
    """``_CheckLaunch.tensors``' addresses for ``batch`` (truth, lengths and held from elsewhere)."""
    rpi, pre, ext, rtt, ids, pos, loc = batch
    other = torch.zeros(2, dtype=torch.int64)
    return [t.data_ptr() for t in (rpi, pre, ext, rtt, lut if lut is not None else other, other, other, ids, pos,
                                   loc, other)]


@pytest.mark.parametrize("with_lut", [False, True])
def test_the_batch_memo_takes_the_same_tensors_at_the_same_addresses_only(with_lut):
    from kvcanary.ops.bound import BatchMemo

    gen = torch.Generator().manual_seed(11)
    batch = _memo_batch(gen, "cpu")
    lut = torch.randint(0, 9, (20,), generator=gen) if with_lut else None
    memo = BatchMemo()
    assert not memo.holds(batch, lut, 0)
    sizes = (7, 3, 4, 16, 16, 20 if with_lut else 0)
    memo.remember(batch, lut, _addresses(batch, lut), 0, sizes)
    assert memo.holds(batch, lut, 0) and memo.laid(_addresses(batch, lut), lut) == sizes
    assert not memo.holds(batch, lut, 1)  # another device
    copy = tuple(t.clone() for t in batch)  # equal values, other tensors
    assert not memo.holds(copy, lut, 0)
    if with_lut:
        assert not memo.holds(batch, lut.clone(), 0)
    for i in range(7):  # a tensor whose storage moved in place: its address is not the one remembered
        moved = list(batch)
        t = moved[i]
        t.set_(t.clone().untyped_storage(), 0, t.shape, t.stride())
        assert memo.holds(batch, lut, 0) and memo.laid(_addresses(batch, lut), lut) is None
        memo.remember(batch, lut, _addresses(batch, lut), 0, sizes)  # laid out again
        assert memo.laid(_addresses(batch, lut), lut) == sizes
    if with_lut:
        lut.set_(lut.clone().untyped_storage(), 0, lut.shape, lut.stride())
        assert memo.laid(_addresses(batch, lut), lut) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the memo serves device batches")
def test_a_tail_after_its_head_reads_no_layout_again_and_gives_check_forwards_bytes(monkeypatch):
    from kvcanary.ops.bound import BatchMemo

    w = make_world(torch.Generator().manual_seed(12), [9, 4, 0], [3, 1, 2], mode=FingerprintMode.PARTIAL,
                   with_truth=True, corrupt=0.2, lut=False, window=0, stamp=True, tag=0)
    got, layouts = {}, []
    sizes = BoundCheck._sizes
    monkeypatch.setattr(BoundCheck, "_sizes", lambda self, *a, **k: layouts.append(1) or sizes(self, *a, **k))
    for bound in (False, True):
        state = state_of(w, 4, 8)
        sources = on_device(w["sources"], DEV)
        batch = {k: on_device(w[k], DEV) for k in BATCH}
        truth, lens = on_device(w["truth"], DEV), padded_lens(w, 4, torch.Generator().manual_seed(1))
        if bound:
            memo = BatchMemo()
            head, tail = (BoundCheck(state, stamp=stamp, sources=sources, mode=FingerprintMode.PARTIAL, truth=truth,
                                     truth_lens=lens, memo=memo) for stamp in (True, False))
            assert head(*batch.values(), tag=0, truth=True) and layouts == [1]
            assert tail(*batch.values(), tag=1, truth=True) and layouts == [1]  # the memo's sizes
            moved = batch["positions"]
            moved.set_(moved.clone().untyped_storage(), 0, moved.shape, moved.stride())
            assert tail(*batch.values(), tag=1, truth=True) and layouts == [1, 1]  # a moved tensor: laid out again
        else:
            for stamp, tag in ((True, 0), (False, 1), (False, 1)):
                check_forward(state=state, **batch, tag=tag, stamp=stamp, truth=truth, truth_lens=lens[:3],
                              sources=sources, mode=FingerprintMode.PARTIAL, backend=Backend.TRITON)
        got[bound] = outputs(state, sources)
    for name, want in got[False].items():
        assert_same(f"{name} (bound, memo)", got[True][name], want)
