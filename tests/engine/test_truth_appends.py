"""Token truth as appends (``EngineConfig.truth_appends``, ``ForwardBatch.truth_starts``): each
batch hands each request's history from what its row's truth holds on (a decode batch: one new
token a request), and the canary's truth table must hold, at every step, what whole histories
would have written; a row given to a new request starts again from its whole history."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcanary.config import CanaryConfig, Policy
from kvcanary.engine import Engine, ModelConfig
from kvcanary.engine.canary_hooks import attach_canary
from kvcanary.engine.cuda_graph import CapturedStep, DecodeGraphs
from kvcanary.engine.forward_batch import appended_buffer, build_forward_batch, one_buffer
from kvcanary.engine.request import Request
from kvcanary.ops.fingerprint import FingerprintMode
from kvcanary.runtime.batch import BatchError, ForwardBatch

from ._helpers import engine_config, random_prompts

# few slots (preemptions: rows freed and given again), a host tier, padded decode batches
TIGHT = dict(num_slots=320, host_tier_slots=96, graph_batch_sizes=(2, 4, 8), max_running=8)


# a hybrid model: a window canary beside the full one, each with a truth table of its own
HYBRID = ModelConfig(num_layers=4, sliding_window=6, window_layers=(0, 2), seed=3)


def run(appends: bool, seed: int, model: ModelConfig | None = None):
    engine, hooks = attach_canary(lambda h: Engine(model or ModelConfig(), engine_config(truth_appends=appends,
                                                                                      **TIGHT), h),
                                  CanaryConfig(policy=Policy.LOG, real_kv=FingerprintMode.PARTIAL, sweep_interval=4))
    canaries = [c for c in (hooks.canary, hooks.window_canary) if c is not None]
    seen = []
    after = hooks.after_forward

    def watch(batch: ForwardBatch) -> None:  # each request's truth row as HEAD and TAIL read it, in each canary
        rows = batch.req_pool_indices.tolist()
        seen.append((batch.truth_starts is not None, [{
            rid: c.truth[row, :n].tolist()
            for rid, row, n in zip(batch.request_ids, rows, c.truth_lens[: batch.batch_size].tolist(), strict=True)
            if rid is not None} for c in canaries]))
        after(batch)

    hooks.after_forward = watch
    out = engine.generate(random_prompts(seed, 20, min_len=8, max_len=40, prefix_len=24), 20)
    for c in canaries:
        c.flush(engine.step_index)
    return engine, hooks, out, seen


@pytest.mark.parametrize("seed, model", [(3, None), (4, None), (5, HYBRID)], ids=["3", "4", "hybrid"])
def test_appends_leave_the_truth_whole_histories_would(seed, model):
    base_engine, base_hooks, base_out, base_seen = run(False, seed, model)
    engine, hooks, out, seen = run(True, seed, model)
    assert len(seen[0][1]) == (2 if model is HYBRID else 1)
    assert out == base_out  # every token emitted
    assert [s for _, s in seen] == [s for _, s in base_seen]  # every step's truth, row by row
    assert not any(a for a, _ in base_seen)
    assert all(a for a, _ in seen)  # every batch hands appends
    assert engine.stats.num_preemptions > 0 and engine.stats.num_offloaded_slots > 0  # rows given again
    for h in (base_hooks, hooks):
        assert h.canary.totals.violations == 0 and h.reports == []


def _request(rid: int, row: int, prompt: list[int], outputs: list[int], truth_len: int) -> Request:
    req = Request(rid, prompt, 8, output_ids=list(outputs), row=row, truth_len=truth_len)
    req.num_cached = req.num_tokens - 1  # a decode writes its last token
    return req


def test_a_batch_appends_what_each_row_lacks():
    table = torch.zeros(4, 16, dtype=torch.int32)
    a = _request(1, 1, [11, 12, 13], [14, 15], truth_len=4)
    b = _request(2, 3, [21, 22], [23], truth_len=2)
    batch = build_forward_batch([(a, 1), (b, 1)], table, num_padding=1, appends=True)
    assert batch.truth_starts.tolist() == [4, 2, 0] and batch.truth_ids.tolist() == [15, 23, 0]
    assert batch.truth_offsets.tolist() == [0, 1, 2, 3] and (a.truth_len, b.truth_len) == (5, 3)
    # a request re-admitted into a new row (truth_len 0) with all but one token cached: its whole
    # history from column 0, beside the other's one new token
    c = _request(3, 2, [31, 32, 33], [34], truth_len=0)
    a.output_ids.append(16)
    a.num_cached += 1
    batch = build_forward_batch([(a, 1), (c, 1)], table, appends=True)
    assert batch.truth_starts.tolist() == [5, 0] and batch.truth_offsets.tolist() == [0, 1, 5]
    assert batch.truth_ids.tolist() == [16, 31, 32, 33, 34] and (a.truth_len, c.truth_len) == (6, 4)
    # a prefill chunk after the first: its history (the whole prompt) went with the first chunk
    d = Request(4, [41, 42, 43, 44, 45], 8, row=3)
    first = build_forward_batch([(d, 3)], table, appends=True)
    assert first.truth_starts.tolist() == [0] and first.truth_ids.tolist() == [41, 42, 43, 44, 45]
    d.num_cached = 3
    rest = build_forward_batch([(d, 2)], table, appends=True)
    assert rest.truth_starts.tolist() == [5] and rest.truth_ids.tolist() == [] and d.truth_len == 5
    # drafts: the history without them, as whole histories; a row said to hold more than the
    # history (never, unless its bookkeeping broke): the whole history again
    a.draft_ids = [99]
    c.output_ids.append(35)
    c.num_cached += 1
    c.truth_len = 9
    batch = build_forward_batch([(a, 2), (c, 1)], table, appends=True)
    assert batch.truth_starts.tolist() == [6, 0] and batch.truth_ids.tolist() == [31, 32, 33, 34, 35]
    a.draft_ids = []
    assert build_forward_batch([(a, 1)], table).truth_starts is None  # appends off: whole histories


def test_decode_appends_make_no_copies_of_their_own():
    """The starts of a decode batch of appends are its prefix lengths' tensor, and its offsets
    (0..bs) one tensor kept per size: the same values, no copy of their own each step."""
    table = torch.zeros(4, 16, dtype=torch.int32)
    a = _request(1, 1, [11, 12, 13], [14], truth_len=3)
    b = _request(2, 2, [21, 22], [23, 24], truth_len=3)
    batch = build_forward_batch([(a, 1), (b, 1)], table, num_padding=1, appends=True)
    assert batch.truth_starts is batch.prefix_lens and batch.truth_starts.tolist() == [3, 3, 0]
    assert batch.truth_offsets.tolist() == [0, 1, 2, 3] and batch.truth_ids.tolist() == [14, 24, 0]
    for r, token in ((a, 15), (b, 25)):  # the next decode step: a token sampled and cached each
        r.output_ids.append(token)
        r.num_cached += 1
    again = build_forward_batch([(b, 1), (a, 1)], table, num_padding=1, appends=True)
    assert again.truth_offsets is batch.truth_offsets and again.truth_starts is again.prefix_lens
    assert again.truth_starts.tolist() == [4, 4, 0] and again.truth_ids.tolist() == [25, 15, 0]
    a.output_ids.append(16)
    a.num_cached += 1
    alone = build_forward_batch([(a, 1)], table, appends=True)  # another size: its own kept offsets
    assert alone.truth_offsets.tolist() == [0, 1] and alone.truth_starts is alone.prefix_lens



def test_a_decode_graph_copies_only_the_appends_ids():
    """A graph of decode appends reads its starts from its prefix-length buffer and its offsets
    from the kept 0..bs, so a replay copies the appends' ids and nothing else of the truth; a
    batch whose truth is not one token a request at its prefix end runs eagerly. (The buffers
    and copies, without CUDA: the graph itself is left out.)"""
    table = torch.zeros(4, 16, dtype=torch.int32)
    a = _request(1, 1, [11, 12, 13], [14], truth_len=3)
    b = _request(2, 2, [21, 22], [23, 24], truth_len=3)
    graphs = DecodeGraphs((3,), appends=True)
    first = build_forward_batch([(a, 1), (b, 1)], table, num_padding=1, appends=True)
    assert graphs.eligible(first)
    fixed = graphs.fixed_buffers(first)
    assert fixed.truth_starts is fixed.prefix_lens and fixed.truth_offsets is first.truth_offsets
    graphs.captured[3] = CapturedStep(graph=None, batch=fixed, logits=torch.zeros(0))
    for r, token in ((a, 15), (b, 25)):
        r.output_ids.append(token)
        r.num_cached += 1
    second = build_forward_batch([(b, 1), (a, 1)], table, num_padding=1, appends=True)
    copies = []
    for name in ("req_pool_indices", "prefix_lens", "extend_lens", "input_ids", "positions", "out_cache_loc",
                 "truth_ids", "truth_offsets"):
        buffer = getattr(fixed, name)
        copy = buffer.copy_
        buffer.copy_ = lambda src, non_blocking=False, name=name, copy=copy: (copies.append(name), copy(src))[1]
    replayed = graphs.load(second, device_step=None)
    assert "truth_ids" in copies and "truth_offsets" not in copies and len(copies) == 7
    for name in ("req_pool_indices", "prefix_lens", "input_ids", "truth_ids", "truth_offsets", "truth_starts"):
        assert getattr(replayed, name) is getattr(fixed, name)
        assert getattr(replayed, name).tolist() == getattr(second, name).tolist(), name
    assert replayed.truth_starts.tolist() == [4, 4, 0] and replayed.truth_ids.tolist() == [25, 15, 0]
    # a request re-admitted into a new row: its whole history, eagerly
    c = _request(3, 3, [31, 32, 33], [34], truth_len=0)
    assert not graphs.eligible(build_forward_batch([(a, 1), (c, 1)], table, num_padding=1, appends=True))
    assert not DecodeGraphs((3,), appends=True).eligible(
        build_forward_batch([(a, 1), (b, 1)], table, num_padding=1))  # whole histories: eager under appends


@pytest.mark.parametrize("lens", [(3, 2, 5), (4, 3, 0), (1, 1, 1), (0, 0, 0), (2, 0, 7)])
def test_one_buffer_holds_each_list_16_byte_aligned(lens):
    gen = torch.Generator().manual_seed(sum(lens))
    lists = [torch.randint(-(2**40), 2**40, (n,), generator=gen).tolist() for n in lens]
    host, bounds = one_buffer(*lists)
    assert [b - a for a, b in bounds] == list(lens)
    for xs, (a, b) in zip(lists, bounds, strict=True):
        assert host[a:b].tolist() == xs and host[a:b].data_ptr() % 16 == 0
    assert all(b1 <= a2 for (_, b1), (a2, _) in zip(bounds, bounds[1:], strict=False))  # parts apart


@pytest.mark.parametrize("seed", range(6))
def test_appends_are_built_in_one_buffer_as_one_buffer_lays_out_each_history(seed):
    """``appended_buffer``, the one pass a device batch's appends take, against each request's
    history from what its row holds on (all of it where the row claims more than the history),
    laid out by ``one_buffer``: every word and bound equal, every ``truth_len`` at its history's
    end, for random histories, rows and padding."""
    gen = torch.Generator().manual_seed(seed)

    def draw(hi: int) -> int:
        return int(torch.randint(0, hi + 1, (), generator=gen))

    plan, want = [], []
    n = 1 + draw(6)
    for rid in range(n + 5):
        prompt = torch.randint(1, 2**31, (1 + draw(40),), generator=gen).tolist()
        outputs = torch.randint(1, 2**31, (draw(12),), generator=gen).tolist()
        history = prompt + outputs
        # random, then each edge: a new row, inside the prompt, all of the history (nothing to append), one
        # past it (a row given again: taken as new), inside the outputs
        edges = [0, draw(len(prompt) - 1), len(history), len(history) + 1, len(prompt) + draw(len(outputs))]
        truth_len = draw(len(history) + 3) if rid < n else edges[rid - n]
        start = truth_len if truth_len <= len(history) else 0
        plan.append((_request(rid, rid + 1, prompt, outputs, truth_len), 1))
        want.append((start, history[start:]))
    pad = draw(3)
    ids = [t for _, part in want for t in part]
    ends = [sum(len(part) for _, part in want[: i + 1]) for i in range(len(want))]
    flat, bounds = appended_buffer(plan, pad)
    host, want_bounds = one_buffer([0, *ends, *[len(ids)] * pad], [s for s, _ in want] + [0] * pad, ids)
    assert bounds == want_bounds and flat.dtype == np.int64 and flat.tolist() == host.tolist()
    assert [req.truth_len for req, _ in plan] == [req.num_tokens for req, _ in plan]


@pytest.mark.parametrize("prefill", [True, False], ids=["prefill", "token-a-request"])
@pytest.mark.parametrize("seed", range(4))
def test_a_batchs_input_ids_are_each_requests_tokens_from_its_cached_end(seed, prefill):
    """Each request's history and drafts sliced from ``num_cached``: a batch of more tokens than
    requests (a prefill's) takes them from the prompts' arrays where they are prompt tokens
    (``Request.prompt_array``), chunks inside the prompt, across its end, in the outputs and
    drafts; a batch of one token a request from the one part of the history that token is in."""
    gen = torch.Generator().manual_seed(100 + seed)

    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (), generator=gen))

    table = torch.zeros(12, 128, dtype=torch.int32)
    plan, want = [], []
    for rid in range(draw(1, 8)):
        prompt = torch.randint(1, 2**31, (draw(1 if rid else 2, 40),), generator=gen).tolist()
        req = Request(rid, prompt, 8, output_ids=torch.randint(1, 2**31, (draw(0, 6),), generator=gen).tolist(),
                      row=rid + 1)
        req.draft_ids = torch.randint(1, 2**31, (draw(0, 2),), generator=gen).tolist()
        history = req.token_ids + req.draft_ids
        # a prefill's first: a whole prompt of two tokens or more (more tokens than requests)
        req.num_cached = draw(0, len(history) - 1) if rid or not prefill else 0
        n = (draw(1, len(history) - req.num_cached) if rid else len(prompt)) if prefill else 1
        plan.append((req, n))
        want += history[req.num_cached: req.num_cached + n]
    batch = build_forward_batch(plan, table, appends=True, truth=False)
    assert (len(want) > len(plan)) == prefill
    assert batch.input_ids.dtype == torch.int64 and batch.input_ids.tolist() == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: on the CPU there is no copy to save")
def test_on_cuda_a_batchs_truth_goes_to_the_device_in_one_copy():
    """A decode batch's truth ids share one device buffer with its input ids, and another batch's
    offsets, starts and ids one of their own: each part 16-byte aligned, a write into the input
    ids (a fault's) leaving the truth as it was."""
    table = torch.zeros(4, 16, dtype=torch.int32, device="cuda")
    a = _request(1, 1, [11, 12, 13], [14], truth_len=3)
    c = _request(3, 2, [31, 32, 33], [34], truth_len=0)
    decode = build_forward_batch([(a, 1)], table, num_padding=2, appends=True)
    assert decode.truth_ids.untyped_storage().data_ptr() == decode.input_ids.untyped_storage().data_ptr()
    assert decode.truth_ids.data_ptr() % 16 == 0 and decode.truth_ids.tolist() == [14, 0, 0]
    decode.input_ids[0] += 1
    assert decode.truth_ids.tolist() == [14, 0, 0]
    a.output_ids.append(15)
    a.num_cached += 1
    mixed = build_forward_batch([(a, 1), (c, 1)], table, appends=True)
    parts = (mixed.truth_offsets, mixed.truth_starts, mixed.truth_ids)
    assert len({t.untyped_storage().data_ptr() for t in parts}) == 1 and all(t.data_ptr() % 16 == 0 for t in parts)
    assert [t.tolist() for t in parts] == [[0, 1, 5], [4, 0], [15, 31, 32, 33, 34]]


def test_truth_starts_are_checked_on_construction():
    i64 = lambda *v: torch.tensor(v, dtype=torch.int64)
    base = dict(req_pool_indices=i64(1, 2), prefix_lens=i64(3, 5), extend_lens=i64(1, 1),
                req_to_token=torch.zeros(3, 8, dtype=torch.int32), input_ids=i64(7, 8), positions=i64(3, 5),
                out_cache_loc=i64(10, 11))
    truth = dict(truth_ids=i64(7, 8), truth_offsets=i64(0, 1, 2))
    ForwardBatch(**base, **truth, truth_starts=i64(3, 5))
    with pytest.raises(BatchError, match="truth_starts is given but truth_ids is None"):
        ForwardBatch(**base, truth_starts=i64(3, 5))
    with pytest.raises(BatchError, match=r"truth_starts length 1 != bs \(2\)"):
        ForwardBatch(**base, **truth, truth_starts=i64(3))
    with pytest.raises(BatchError, match=r"truth_starts dtype torch.int32 != torch.int64"):
        ForwardBatch(**base, **truth, truth_starts=i64(3, 5).int())
    with pytest.raises(BatchError, match=r"truth_starts\[1\] = -1 < 0"):
        ForwardBatch(**base, **truth, truth_starts=i64(3, -1))


def _canary_steps(stale: bool):
    """Request A fills row 1, request B row 2; then B decodes from row 1 (its page-table row
    copied there) with an append: its row holds A's history unless ``stale`` is False, when B's
    decode sends its whole history instead. Returns each step's violations."""
    from kvcanary import Canary, PoolGeometry

    gen = torch.Generator().manual_seed(9)
    canary = Canary(CanaryConfig(policy=Policy.LOG, real_kv=FingerprintMode.NONE),
                    PoolGeometry(num_slots=64, rows=3, max_ctx=16, device="cpu"))
    table = torch.zeros(3, 16, dtype=torch.int32)
    table[1, :6], table[2, :6] = torch.arange(1, 7, dtype=torch.int32), torch.arange(11, 17, dtype=torch.int32)
    tokens = torch.randint(0, 1000, (3, 6), generator=gen)
    i64 = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731

    def prefill(row: int) -> ForwardBatch:
        return ForwardBatch(req_pool_indices=i64(row), prefix_lens=i64(0), extend_lens=i64(5), req_to_token=table,
                            input_ids=tokens[row, :5].clone(), positions=torch.arange(5),
                            out_cache_loc=table[row, :5].long(), truth_ids=tokens[row, :5].clone(),
                            truth_offsets=i64(0, 5), request_ids=(row,))

    truth = dict(truth_ids=tokens[2, 5:6].clone(), truth_offsets=i64(0, 1), truth_starts=i64(5)) if stale else \
        dict(truth_ids=tokens[2, :6].clone(), truth_offsets=i64(0, 6))
    decode = ForwardBatch(req_pool_indices=i64(1), prefix_lens=i64(5), extend_lens=i64(1), req_to_token=table,
                          input_ids=tokens[2, 5:6].clone(), positions=i64(5), out_cache_loc=table[2, 5:6].long(),
                          request_ids=(2,), **truth)
    out = []
    for step, b in enumerate((prefill(1), prefill(2), decode)):
        if step == 2:
            table[1] = table[2]  # B moves to row 1 (A is gone)
        with canary.forward(b):
            pass
        out.append(canary.end_step(step).violations)
    return out


@pytest.mark.parametrize("stale", [True, False], ids=["stale_row", "whole_history"])
def test_an_append_onto_another_requests_row_is_reported_at_head(stale):
    first, second, third = _canary_steps(stale)
    assert first == [] and second == []
    if not stale:
        assert third == []
        return
    assert {(v.point.name, tuple(v.reasons.names(v.reasons))) for v in third} == {("HEAD", ("verify_token",)),
                                                                                ("TAIL", ("verify_token",))}
    assert sorted(v.slot for v in third if v.point.name == "HEAD") == list(range(11, 16))  # B's whole prefix
