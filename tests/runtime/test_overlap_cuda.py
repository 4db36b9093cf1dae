"""HEAD's checks and TAIL on the canary's side stream (``CanaryConfig.overlap``) give exactly the
verdicts, records and side words of the canary on one stream, eagerly and inside replayed graphs,
whichever stream runs ahead, with the side stream for every forward (ALWAYS) or for captured
ones only (CAPTURED, which forks nothing eagerly); the reference engine's fault campaign gives
the same verdicts. Runs only where a GPU is present."""

from __future__ import annotations

import pytest
import torch

from kvcanary.config import CanaryConfig, Overlap, Policy
from kvcanary.core.record import CHAIN, Half, Reason, record_words
from kvcanary.engine.config import ModelConfig
from kvcanary.engine.workload import WorkloadConfig, builtin_workload, engine_config_for
from kvcanary.errors import InputError
from kvcanary.ops.fingerprint import FingerprintMode, KVSource
from kvcanary.runs.campaign import run_campaign
from kvcanary.runs.setup import RunSetup
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.canary import Canary, PoolGeometry

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROWS, CTX, LAYERS = 5, 24, 2
NUM_SLOTS = ROWS * CTX + 1
SLEEP = 200_000  # GPU cycles (~0.1 ms): holds one stream back so the other runs ahead


class Pool:
    """K and V of ``LAYERS`` layers over the slots, random bf16, and a canary covering all four."""

    def __init__(self, kv: list[torch.Tensor], overlap: Overlap, mode: FingerprintMode = FingerprintMode.PARTIAL,
                 max_bs: int = 4):
        self.kv = [t.clone() for t in kv]
        sources = [KVSource.from_buffer(self.kv[2 * layer + h], half=half, layer=layer)
                   for layer in range(LAYERS) for h, half in enumerate((Half.K, Half.V))]
        config = CanaryConfig(policy=Policy.LOG, real_kv=mode, max_bs=max_bs, max_tokens=64, sweep_interval=0,
                              overlap=overlap, layers=tuple(range(LAYERS)))
        self.canary = Canary(config, PoolGeometry(NUM_SLOTS, ROWS, CTX, "cuda"), sources=sources)
        assert (self.canary.side is not None) == (overlap is not Overlap.OFF)

    def write(self, batch: ForwardBatch, layer: int, values: list[torch.Tensor], skip: int | None = None) -> None:
        """The forward's K/V writes of one layer (``skip``: the token whose write is dropped)."""
        loc = batch.out_cache_loc if skip is None else torch.cat([batch.out_cache_loc[:skip],
                                                                   batch.out_cache_loc[skip + 1:]])
        for h in range(2):
            v = values[2 * layer + h]
            self.kv[2 * layer + h][loc] = v if skip is None else torch.cat([v[:skip], v[skip + 1:]])


def _kv(gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(NUM_SLOTS, 2, 16, generator=gen).to("cuda", torch.bfloat16) for _ in range(2 * LAYERS)]


def _batch(tokens: torch.Tensor, table: torch.Tensor, prefix: int, extend: int) -> ForwardBatch:
    rows = torch.tensor([1, 2, 3])
    pos = torch.arange(prefix, prefix + extend).repeat(3)
    row_of = rows.repeat_interleave(extend)
    n = prefix + extend
    b = dict(req_pool_indices=rows, prefix_lens=torch.full((3,), prefix), extend_lens=torch.full((3,), extend),
             req_to_token=table, input_ids=tokens[row_of, pos], positions=pos, out_cache_loc=table[row_of, pos].long(),
             truth_ids=tokens[1:4, :n].reshape(-1).contiguous(), truth_offsets=torch.arange(0, 3 * n + 1, n))
    return ForwardBatch(**{k: v.to("cuda") for k, v in b.items()})


def _count_forks(c: Canary) -> list[bool]:
    """Each fork of ``c``'s side stream from now on, as whether it was inside a capture."""
    forks, fork = [], c.route.fork
    c.route.fork = lambda: (forks.append(torch.cuda.is_current_stream_capturing()), fork())[1]
    return forks


def _rows(reports) -> list[tuple]:
    return sorted((v.step, v.slot, int(v.reasons), v.point.name) for r in reports for v in r.violations)


def _eager_run(pool: Pool, gen: torch.Generator, tokens: torch.Tensor, late: str | None) -> list:
    """A prefill of 8 tokens on rows 1..3, then decode steps with faults: a prefix K word of layer 0
    flipped during the forward (step 2), a dropped write (step 3), a record chain flipped before
    HEAD (step 4), a bad page-table entry (step 5). ``late``: the stream held back ahead of the checks."""
    c, reports = pool.canary, []
    table = (torch.arange(ROWS * CTX, dtype=torch.int32) + 1).view(ROWS, CTX)
    for step in range(7):
        prefix, extend = (0, 8) if step == 0 else (7 + step, 1)
        t = table.clone()
        if step == 5:
            t[2, 4] = NUM_SLOTS + 7
        b = _batch(tokens, t, prefix, extend)
        values = [torch.randn(b.out_cache_loc.shape[0], 2, 16, generator=gen).to("cuda", torch.bfloat16)
                  for _ in range(2 * LAYERS)]
        if step == 4:
            record_words(c.state.records)[int(table[3, 5]), CHAIN] ^= 1
        c.prepare_head(b)
        if late == "side":
            with torch.cuda.stream(c.side):
                torch.cuda._sleep(SLEEP)
        c.launch_head(b)
        if late == "main":
            torch.cuda._sleep(SLEEP)
        pool.write(b, 0, values, skip=0 if step == 3 else None)
        if step == 2:
            pool.kv[0][int(table[2, 3])].view(torch.int16).view(-1)[0] ^= 1
        pool.write(b, 1, values)
        c.start_tail(b)
        if late == "main":
            torch.cuda._sleep(SLEEP)
        c.tail(b)
        reports.append(c.end_step(step))
    reports.append(c.flush(7))
    torch.cuda.synchronize()
    return reports


@pytest.mark.parametrize("late", [None, "main", "side"])
def test_the_side_stream_gives_the_verdicts_records_and_side_words_of_one_stream(late):
    gen = torch.Generator().manual_seed(31)
    tokens = torch.randint(1, 50_000, (ROWS, CTX), generator=gen)
    kv = _kv(gen)
    runs = {}
    for overlap in Overlap:
        pool = Pool(kv, overlap)
        forks = _count_forks(pool.canary)
        rows = _rows(_eager_run(pool, torch.Generator().manual_seed(32), tokens,
                                late if overlap is not Overlap.OFF else None))
        runs[overlap] = (rows, pool.canary.state.records.cpu(), pool.canary.state.source_tags.cpu())
        # eagerly only ALWAYS forks: HEAD and TAIL of each of the 7 forwards
        assert len(forks) == (14 if overlap is Overlap.ALWAYS else 0), overlap
    rows, records, tags = runs[Overlap.OFF]
    for overlap in (Overlap.ALWAYS, Overlap.CAPTURED):
        assert runs[overlap][0] == rows, overlap
        assert torch.equal(runs[overlap][1], records) and torch.equal(runs[overlap][2], tags), overlap
    first = {}
    for step, _slot, reasons, point in rows:
        for r in Reason:
            if reasons & r:
                first.setdefault(r.name, (step, point))
    assert first["FINGERPRINT"] == (2, "TAIL")
    assert first["MISSED_WRITE"] == (3, "TAIL")
    assert first["CHAIN"] == (4, "HEAD")
    assert first["BAD_ENTRY"] == (5, "HEAD")


def test_the_clean_twin_reports_nothing_on_either_stream():
    gen = torch.Generator().manual_seed(33)
    tokens = torch.randint(1, 50_000, (ROWS, CTX), generator=gen)
    pool = Pool(_kv(gen), Overlap.ALWAYS)
    c = pool.canary
    table = (torch.arange(ROWS * CTX, dtype=torch.int32) + 1).view(ROWS, CTX)
    reports = []
    for step in range(6):
        b = _batch(tokens, table, *((0, 8) if step == 0 else (7 + step, 1)))
        values = [torch.randn(b.out_cache_loc.shape[0], 2, 16, generator=gen).to("cuda", torch.bfloat16)
                  for _ in range(2 * LAYERS)]
        c.prepare_head(b)
        c.launch_head(b)
        torch.cuda._sleep(SLEEP)
        pool.write(b, 0, values)
        pool.write(b, 1, values)
        c.tail(b)  # TAIL started here, not by start_tail
        reports.append(c.end_step(step))
    reports.append(c.flush(6))
    assert _rows(reports) == [] and c.counters()["TAIL"]["checked"] > 0


def _graph(pool: Pool, b: ForwardBatch, values: list[torch.Tensor]) -> torch.cuda.CUDAGraph:
    c = pool.canary

    def step():
        c.launch_head(b)
        torch.cuda._sleep(SLEEP)
        pool.write(b, 0, values)
        pool.write(b, 1, values)
        c.start_tail(b)
        torch.cuda._sleep(SLEEP)
        c.tail(b)

    c.prepare_head(b)
    step()
    c.end_step(1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def test_replayed_graphs_give_the_verdicts_of_one_stream():
    gen = torch.Generator().manual_seed(34)
    tokens = torch.randint(1, 50_000, (ROWS, CTX), generator=gen)
    kv = _kv(gen)
    table = (torch.arange(ROWS * CTX, dtype=torch.int32) + 1).view(ROWS, CTX)
    fill, step_b = _batch(tokens, table, 0, 8), _batch(tokens, table, 8, 1)
    values = [torch.randn(3, 2, 16, generator=gen).to("cuda", torch.bfloat16) for _ in range(2 * LAYERS)]
    fill_values = [torch.randn(24, 2, 16, generator=gen).to("cuda", torch.bfloat16) for _ in range(2 * LAYERS)]
    out = {}
    for overlap in Overlap:
        pool = Pool(kv, overlap)
        c = pool.canary
        forks = _count_forks(c)
        with c.forward(fill):
            pool.write(fill, 0, fill_values)
            pool.write(fill, 1, fill_values)
        c.end_step(0)
        graph = _graph(pool, step_b, values)
        # the fill and the eager step before the capture fork under ALWAYS only; the capture forks twice
        eager = 4 if overlap is Overlap.ALWAYS else 0
        assert forks == [False] * eager + ([True, True] if overlap is not Overlap.OFF else []), overlap
        reports = []
        for step in range(2, 8):
            if step == 4:
                record_words(c.state.records)[int(table[1, 2]), CHAIN] ^= 1
            if step == 6:
                pool.kv[2][int(table[3, 6])].view(torch.int16).view(-1)[3] ^= 1  # K of layer 1
            c.prepare_head(step_b)
            graph.replay()
            reports.append(c.end_step(step))
        reports.append(c.flush(8))
        out[overlap] = (_rows(reports), c.state.records.cpu(), c.state.source_tags.cpu())
    for overlap in (Overlap.ALWAYS, Overlap.CAPTURED):
        assert out[overlap][0] == out[Overlap.OFF][0], overlap
        assert torch.equal(out[overlap][1], out[Overlap.OFF][1]), overlap
        assert torch.equal(out[overlap][2], out[Overlap.OFF][2]), overlap
    steps = {(step, point) for step, _, _, point in out[Overlap.OFF][0]}
    assert (4, "HEAD") in steps and (6, "TAIL") in steps and not any(s < 4 for s, _ in steps)


def _setup(overlap: Overlap) -> RunSetup:
    workload = builtin_workload(WorkloadConfig(num_requests=48, seed=0))
    config = CanaryConfig(sweep_interval=4, overlap=overlap)
    return RunSetup(ModelConfig(seed=0), engine_config_for(workload, device="cuda"), config, workload)


def test_the_fault_campaign_gives_the_same_verdicts_on_the_side_stream():
    verdicts = {}
    for overlap in Overlap:
        result = run_campaign(_setup(overlap))
        assert result.clean_violations == 0
        verdicts[overlap] = [(v.fault, v.injected, v.detected, v.first_detection, v.false_positives)
                             for v in result.verdicts]
    assert verdicts[Overlap.ALWAYS] == verdicts[Overlap.OFF] == verdicts[Overlap.CAPTURED]
    assert all(d for _, injected, d, _, _ in verdicts[Overlap.OFF] if injected)


def test_the_reference_engine_starts_tail_inside_its_model_and_stays_clean():
    from kvcanary.engine.canary_hooks import attach_canary
    from kvcanary.engine.config import EngineConfig
    from kvcanary.engine.engine import Engine

    mc = ModelConfig(vocab_size=512, hidden=128, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
                     intermediate=256)
    ec = EngineConfig(num_slots=1200, max_rows=17, max_ctx=128, max_running=8, device="cuda", cuda_graph=True,
                      graph_batch_sizes=(1, 2, 4, 8))
    engine, hooks = attach_canary(lambda h: Engine(mc, ec, h), CanaryConfig(sweep_interval=4))
    assert hooks.tail_layer == 2
    started = []
    start_tail = hooks.canary.start_tail
    hooks.canary.start_tail = lambda b: (started.append(b.batch_size), start_tail(b))[1]
    gen = torch.Generator().manual_seed(35)
    lengths = torch.randint(5, 40, (12,), generator=gen).tolist()
    out = engine.generate([torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths], 12)
    hooks.canary.flush(engine.step_index)
    assert len(out) == 12 and all(out.values())
    assert started and hooks.canary.totals.violations == 0 and not hooks.reports
    assert engine.graphs.replays > 0  # replayed graphs hold the early TAIL too


def test_a_batch_the_side_stream_head_refuses_writes_nothing_on_either_stream():
    gen = torch.Generator().manual_seed(36)
    tokens = torch.randint(1, 50_000, (ROWS, CTX), generator=gen)
    pool = Pool(_kv(gen), True, max_bs=2)
    c = pool.canary
    table = (torch.arange(ROWS * CTX, dtype=torch.int32) + 1).view(ROWS, CTX)
    big = _batch(tokens, table, 0, 4)  # 3 requests > max_bs 2: HEAD's workspace is too small
    kv, records = [t.clone() for t in pool.kv], c.state.records.clone()
    with pytest.raises(InputError):  # launch_head straight away (prepare_head refuses the batch itself)
        c.launch_head(big)
    c.join()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(kv, pool.kv, strict=True))  # no write mark landed
    assert torch.equal(records, c.state.records)
