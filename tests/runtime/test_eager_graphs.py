"""An eager forward's HEAD and TAIL as graph replays (``runtime.eager_graphs``).

On the CPU (the Triton kernel interpreted): a bucket's padded batch leaves every byte the check
writes as the batch alone leaves it. Two canaries in the same state run one forward, one through
its bound checks on the batch, the other through the same bound checks on ``EagerBuffers`` of a
larger bucket, loaded from the batch, as a captured graph reads them: records, side words, ring
rows, counters, truth rows and lengths, held words. The forward writes into a held slot, reads a
damaged prefix and scatters its token truth (whole histories or appends), so each part of the check
reports something. On CUDA: the canary with ``eager_graphs`` replays its buckets' graphs and finds
what the canary without them finds."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvcanary.config import CanaryConfig
from kvcanary.core.record import FINGERPRINT, LaunchPoint, Reason, record_words
from kvcanary.errors import ConfigError
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.canary import Canary
from kvcanary.runtime.eager_graphs import EagerBuffers, bucket

from ._helpers import prefilled, read_all

NUM_SLOTS, ROWS, CTX = 320, 4, 80


def test_a_bucket_is_the_power_of_two_at_or_above_within_the_cap():
    assert [bucket(k, 64) for k in (0, 1, 2, 3, 4, 5, 31, 32, 33, 64, 65)] == [1, 1, 2, 4, 4, 8, 32, 32, 64, 64, 64]
    assert bucket(9, 12) == 12 and bucket(12, 12) == 12


def test_eager_graphs_must_be_a_bool():
    with pytest.raises(ConfigError, match="CanaryConfig.eager_graphs must be True or False, got 1"):
        CanaryConfig(eager_graphs=1)


def _forward(c: Canary, slots: list[list[int]], tokens: list[list[int]], seed: int, appends: bool,
             device: str = "cpu", rows: tuple = (1, 3), extend: tuple = (1, 3),
             table: torch.Tensor | None = None) -> ForwardBatch:
    """``rows`` extend their prefilled histories by ``extend`` tokens into free slots (by default
    rows 1 and 3 by 1 and 3; row 2 sits out): whole histories as truth, or appends of the new
    tokens. ``table``: the page table to fill in place (an engine's, the same tensor every step)."""
    gen = torch.Generator().manual_seed(seed)
    free = sorted(set(range(1, NUM_SLOTS)) - set(sum(slots, [])))
    free = [free[i] for i in torch.randperm(len(free), generator=gen).tolist()]
    host = torch.zeros(ROWS, CTX, dtype=torch.int32)
    for r, s in enumerate(slots, start=1):
        host[r, : len(s)] = torch.tensor(s, dtype=torch.int32)
    ids, pos, loc, histories, news = [], [], [], [], []
    for row, k in zip(rows, extend, strict=True):
        p = len(slots[row - 1])
        new = torch.randint(0, 30_000, (k,), generator=gen).tolist()
        targets = [free.pop() for _ in range(k)]
        host[row, p: p + k] = torch.tensor(targets, dtype=torch.int32)
        ids += new
        pos += list(range(p, p + k))
        loc += targets
        histories.append(tokens[row - 1] + new)
        news.append(new)
    i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    prefix = [len(slots[r - 1]) for r in rows]
    parts = news if appends else histories
    flat, offsets = sum(parts, []), [0, *itertools.accumulate(map(len, parts))]
    starts = i64(prefix) if appends else None
    if table is None:
        table = host.to(device)
    else:
        table.copy_(host)
    return ForwardBatch(i64(list(rows)), i64(prefix), i64(list(extend)), table, i64(ids), i64(pos), i64(loc),
                        truth_ids=i64(flat), truth_offsets=i64(offsets), truth_starts=starts)


def _load_junk(buffers: EagerBuffers, gen: torch.Generator) -> None:
    """A batch that fills ``buffers``: live rows, prefixes, slots and truth segments."""
    bs, n, nt = buffers.bs, buffers.n, buffers.n_tids
    cut = lambda total: torch.cat([torch.zeros(1, dtype=torch.int64),  # noqa: E731
                                   torch.sort(torch.randint(0, total + 1, (bs - 1,), generator=gen))[0],
                                   torch.tensor([total])])
    ends = cut(n)
    rand = lambda hi, k: torch.randint(1, hi, (k,), generator=gen)  # noqa: E731
    buffers.load(rand(ROWS, bs), rand(CTX // 2, bs), ends[1:] - ends[:-1], rand(30_000, n), rand(CTX, n),
                 rand(NUM_SLOTS, n), rand(30_000, nt), cut(nt), rand(CTX // 2, bs) if buffers.starts is not None
                 else None)


def _state(c: Canary, bs: int) -> dict:
    s = c.state
    ring = s.ring[: int(s.ring_counter[0])].tolist()
    return {"records": record_words(s.records).clone(), "side words": s.source_tags.clone(),
            "counter": s.ring_counter.clone(), "stats": s.stats.clone(), "ring": sorted(ring),
            "truth rows": c.truth[1:].clone(), "truth lengths": c.truth_lens[:bs].clone(),
            "held words": c.holds.counted.clone(), "error": s.error.clone()}


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test (the CUDA case replays the graphs)")
@pytest.mark.parametrize(("seed", "appends", "buckets"), [(31, False, (4, 8, 16)), (32, True, (3, 4, 4)),
                                                          (33, False, (3, 4, 64)), (34, True, (4, 32, 8)),
                                                          (35, True, (2, 4, 0)), (36, False, (2, 4, 0))])
def test_a_padded_bucket_leaves_every_byte_as_the_batch_alone(seed, appends, buckets):
    bs_cap, n_cap, tids_cap = buckets  # 2 requests, 4 tokens
    runs = []
    for padded in (False, True):
        c, slots, tokens = prefilled(seed, "cpu", NUM_SLOTS, CTX, 20, 256, fused=True)
        b = _forward(c, slots, tokens, seed, appends)
        record_words(c.state.records)[slots[2][5], FINGERPRINT] ^= 1 << 9  # a damaged prefix slot: HEAD reports it
        c.hold(torch.tensor([slots[1][3], int(b.out_cache_loc[2])], dtype=torch.int64))  # one a write target
        head, tail = c.route.bound["head"], c.route.bound["tail"]
        tags = c.ctx.tags[LaunchPoint.HEAD], c.ctx.tags[LaunchPoint.TAIL]
        c.prepare_head(b, eager=True)
        if not padded:
            c.launch_head(b)
            c.tail(b)
        else:  # what a bucket's graphs launch, over the buffers the batch was loaded into
            nt = b.truth_ids.shape[0]
            buffers = EagerBuffers(bs_cap, n_cap, max(tids_cap, nt), appends, "cpu")
            _load_junk(buffers, torch.Generator().manual_seed(seed))  # a full batch before: nothing of it may stay
            buffers.load(b.req_pool_indices, b.prefix_lens, b.extend_lens, b.input_ids, b.positions,
                         b.out_cache_loc, b.truth_ids, b.truth_offsets, b.truth_starts)
            batch = buffers.batch(b.req_to_token)
            assert head(*batch, tag=tags[0], truth=True, held_words=c.holds.counted, truth_ids=buffers.tids,
                        truth_offsets=buffers.toff, truth_starts=buffers.starts)
            c.route.scatter_for, c.held = None, None
            assert tail(*batch, tag=tags[1], truth=True)
        runs.append(_state(c, 2))
        found = read_all(c, 1)
        reasons = {(v.point.name, Reason(v.reasons)) for v in found}
        assert {("HEAD", Reason.READ_CONFLICT), ("TAIL", Reason.FINGERPRINT), ("TAIL", Reason.MISSED_WRITE)} <= reasons
    for name, want in runs[0].items():
        got = runs[1][name]
        assert (torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want), name


# (rows, extend, appends) of each step: three buckets, the first taken again at the last step
STEPS = [((1, 3), (1, 3), False), ((1, 3), (1, 3), True), ((1, 2, 3), (2, 2, 2), False), ((1, 3), (1, 3), False)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test (the CUDA case replays the graphs)")
def test_eager_graphs_through_the_canary_find_what_its_launches_find():
    """The canary's own HEAD and TAIL paths with eager graphs (on the CPU each bucket launches its
    bound checks over its buffers instead of replaying a graph): four eager forwards over three
    buckets, each with a damaged prefix slot and a held write target, against the same canary
    without them; the same violations each step, and the same records, side words, ring, truth
    and held words after."""
    found, states = [], []
    for graphs in (False, True):
        c, slots, tokens = prefilled(51, "cpu", NUM_SLOTS, CTX, 20, 256, fused=True, eager_graphs=graphs)
        assert (c.route.eager is not None) is graphs
        before = (c.route.eager.replays, len(c.route.eager.graphs)) if graphs else None  # the prefill's bucket
        got, table = [], torch.zeros(ROWS, CTX, dtype=torch.int32)
        for step, (rows, extend, appends) in enumerate(STEPS, start=1):
            b = _forward(c, slots, tokens, 50 + step, appends, rows=rows, extend=extend, table=table)
            record_words(c.state.records)[slots[2][4 + step], FINGERPRINT] ^= 1 << 9
            c.hold(torch.tensor([slots[1][3], int(b.out_cache_loc[1])], dtype=torch.int64))
            c.prepare_head(b, eager=True)
            c.launch_head(b)
            c.tail(b)
            got.append(sorted((v.slot, v.point.name, int(v.reasons), v.expected_value) for v in read_all(c, 2 * step)))
            assert {"HEAD", "TAIL"} <= {p for _, p, _, _ in got[-1]}
        if graphs:
            assert (c.route.eager.replays - before[0], len(c.route.eager.graphs) - before[1]) == (len(STEPS), 3)
        found.append(got)
        states.append(_state(c, len(STEPS[-1][0])))  # the last batch's lengths (the rest are scratch)
    assert found[1] == found[0]
    for name, want in states[0].items():
        got = states[1][name]
        assert (torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test")
def test_a_capture_that_raises_leaves_its_bucket_to_the_launches(monkeypatch, caplog):
    """A bucket whose capture raises is launched as before, named once in the log and in
    ``failure``; the forward's violations are those of a canary without eager graphs."""
    found = []
    for graphs in (False, True):
        c, slots, tokens = prefilled(52, "cpu", NUM_SLOTS, CTX, 20, 256, fused=True, eager_graphs=graphs)
        if graphs:
            def refuse(key, rtt):
                raise RuntimeError("operation not permitted when stream is capturing")
            monkeypatch.setattr(c.route.eager, "_capture", refuse)
            before, kept = c.route.eager.replays, set(c.route.eager.graphs)  # the prefill's bucket
        got, table = [], torch.zeros(ROWS, CTX, dtype=torch.int32)
        for step in (1, 2):  # one bucket: its capture raises once
            b = _forward(c, slots, tokens, 60 + step, False, table=table)
            c.hold(torch.tensor([int(b.out_cache_loc[1])], dtype=torch.int64))
            c.prepare_head(b, eager=True)
            c.launch_head(b)
            c.tail(b)
            got.append(sorted((v.slot, v.point.name, int(v.reasons)) for v in read_all(c, 2 * step)))
        found.append(got)
        if graphs:
            assert c.route.eager.failure == "RuntimeError: operation not permitted when stream is capturing"
            assert c.route.eager.replays == before
            assert [c.route.eager.graphs[k] for k in set(c.route.eager.graphs) - kept] == [None]
    assert found[1] == found[0] and all(("HEAD" in {p for _, p, _ in g}) for g in found[0])
    assert sum("a capture failed" in r.getMessage() for r in caplog.records) == 1


def test_buffers_reloaded_from_a_smaller_batch_pad_what_the_larger_one_left():
    """A bucket's buffers serve every batch of the bucket: a smaller batch after a larger one leaves
    none of the larger one's requests, tokens or truth segments behind."""
    buffers = EagerBuffers(4, 8, 16, True, "cpu")
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    buffers.load(i64([1, 2, 3, 1]), i64([5, 6, 7, 8]), i64([2, 2, 2, 2]), i64([9] * 8), i64([4] * 8),
                 i64([11, 12, 13, 14, 15, 16, 17, 18]), i64(list(range(16))), i64([0, 4, 8, 12, 16]),
                 i64([1, 1, 1, 1]))
    buffers.load(i64([3]), i64([2]), i64([3]), i64([7, 8, 9]), i64([2, 3, 4]), i64([21, 22, 23]), i64([5, 6, 7]),
                 i64([0, 3]), i64([2]))
    assert buffers.rpi.tolist() == [3, 0, 0, 0] and buffers.prefix.tolist() == [2, 0, 0, 0]
    assert buffers.extend.tolist() == [3, 5, 0, 0]  # the padded tokens are the first padded request's
    assert buffers.loc.tolist() == [21, 22, 23, 0, 0, 0, 0, 0]
    assert buffers.toff.tolist() == [0, 3, 16, 16, 16] and buffers.starts.tolist() == [2, 0, 0, 0]
    assert buffers.tids[:3].tolist() == [5, 6, 7]


# --- CUDA -----------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("appends", [False, True], ids=["whole", "appends"])
def test_eager_graphs_replay_each_bucket_and_find_what_launches_find(appends):
    """The same forward, then a damaged prefix, a held write target and a write no model made,
    on two canaries in one state: with ``eager_graphs`` (HEAD and TAIL replayed) and without; the
    same violations, records and side words. A second batch of the same bucket replays the graphs
    captured by the first."""
    found, records = [], []
    for graphs in (False, True):
        c, slots, tokens = prefilled(41, "cuda", NUM_SLOTS, CTX, 20, 256, eager_graphs=graphs)
        assert (c.route.eager is not None) == graphs
        before = (c.route.eager.replays, len(c.route.eager.graphs)) if graphs else None  # the prefill's bucket
        got, table = [], torch.zeros(ROWS, CTX, dtype=torch.int32, device="cuda")
        for step, seed in enumerate((41, 42), start=1):
            b = _forward(c, slots, tokens, seed, appends, "cuda", table=table)
            record_words(c.state.records)[slots[2][4 + step], FINGERPRINT] ^= 1 << 9
            c.hold(torch.tensor([slots[1][3], int(b.out_cache_loc[2])], dtype=torch.int64))
            c.prepare_head(b, eager=True)
            c.launch_head(b)
            c.tail(b)  # no model wrote the targets: missed writes at TAIL
            got += [(v.step, v.slot, v.point.name, int(v.reasons)) for v in read_all(c, 2 * step)]
        if graphs:
            assert (c.route.eager.replays - before[0], len(c.route.eager.graphs) - before[1]) == (2, 1)
        found.append(sorted(got))
        records.append((record_words(c.state.records).cpu(), c.state.source_tags.cpu()))
    assert found[0] == found[1] and found[0]
    assert {p for _, _, p, _ in found[0]} >= {"HEAD", "TAIL"}
    assert torch.equal(records[0][0], records[1][0]) and torch.equal(records[0][1], records[1][1])
