"""The agreement's device half captured in a CUDA graph on one GPU (NCCL, world size 1): replays
build the same tables as eager launches (step, rows, reasons, digest), a ring row appended before
a replay is in that step's table, read one step late under log and in the step under recompute.
Runs only where a CUDA device is present (pytest -m gpu)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kvcanary.config import CanaryConfig, Policy
from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.distributed import RankAgreement, chain_digest
from kvcanary.distributed.signal import CODE, DIGEST, ROWS, STEP, decode_code
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.canary import Canary, PoolGeometry

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def nccl_group(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = tmp_path_factory.mktemp("nccl") / "store"
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def decode_batch(bs: int, num_slots: int, gen: torch.Generator) -> ForwardBatch:
    slots = torch.randperm(num_slots - 1, generator=gen)[:bs] + 1
    table = torch.zeros(bs + 1, 8, dtype=torch.int32)
    table[1:, 5] = slots.int()
    n = lambda v: torch.full((bs,), v, dtype=torch.int64)  # noqa: E731
    return ForwardBatch(torch.arange(1, bs + 1).cuda(), n(5).cuda(), n(1).cuda(), table.cuda(),
                        torch.randint(0, 1000, (bs,), generator=gen).cuda(), n(5).cuda(), slots.cuda(),
                        request_ids=tuple(range(bs)))


def append_row(canary: Canary, point: LaunchPoint, reasons: Reason) -> None:
    """As a check would: one violation row at the counter, the counter advanced (on the device)."""
    state = canary.state
    i = int(state.ring_counter)
    state.ring[i, 0], state.ring[i, 7] = int(point) * 4, int(reasons)
    state.ring_counter.add_(1)


@pytest.mark.usefixtures("nccl_group")
@pytest.mark.parametrize("policy", [Policy.LOG, Policy.RECOMPUTE], ids=["log", "recompute"])
def test_captured_signal_equals_eager_and_reads_with_its_lag(policy):
    gen = torch.Generator().manual_seed(5)
    config = CanaryConfig(policy=Policy.LOG, sweep_interval=0, watchdog_window=1 << 30)
    canary = Canary(config, PoolGeometry(512, 33, 8, "cuda"))
    words = canary.state.records.view(torch.int64)
    words.copy_(torch.randint(0, 2**62, words.shape, generator=gen).cuda())
    batch = decode_batch(32, 512, gen)
    digest = int(chain_digest(canary.state.records, batch.req_pool_indices, batch.extend_lens, batch.out_cache_loc))
    agreement = RankAgreement(canary, policy)
    reads = {}  # signal step -> (step whose end_step read it, table)

    def take(report, step):
        for s, t in zip(report.agreed_steps, report.tables, strict=True):
            reads[s] = (step, t)

    for step in range(3):  # eager
        agreement.launch(step, batch)
        take(agreement.end_step(step), step)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        agreement.issue(batch)
        agreement.join()
    for step in range(3, 9):  # replays; a HEAD chain row at step 5
        if step == 5:
            append_row(canary, LaunchPoint.HEAD, Reason.CHAIN)
        agreement.prepare(step)
        graph.replay()
        agreement.launched(step, batch, replayed=True)
        take(agreement.end_step(step), step)
    take(agreement.finish(9), 9)
    lag = agreement.lag
    assert lag == (0 if policy is Policy.RECOMPUTE else 1)
    assert sorted(reads) == list(range(10))
    for s in range(9):
        read_at, table = reads[s]
        assert read_at == s + lag and table[0][STEP] == s and table[0][DIGEST] == digest
        assert table[0][ROWS] == (1 if s == 5 else 0)
    reasons, points, alarm = decode_code(reads[5][1][0][CODE])
    assert reasons == Reason.CHAIN and points == (LaunchPoint.HEAD,) and not alarm
    assert reads[9][1][0][DIGEST] == 0  # finish signals without a batch
