"""Counters across their wrap: a canary whose long-lived counters start just below their wrap
points runs a workload across them, with faults injected, on every path.

The counters set here (each through its owner's test-facing setter):

| counter                     | setter                   | started at           | crosses at step 2   |
|-----------------------------|--------------------------|----------------------|---------------------|
| write-conflict marks' epoch | ``WriteMarks.set_epoch`` | EPOCH_LIMIT - 2      | the marks' restart  |
| HEAD / TAIL workspace epoch | ``Workspace.set_epoch``  | 2**61 - 2, 2**63 - 2 | 4 * epoch wraps, or |
|                             |                          |                      | the word itself     |
| launch stats (int64 words)  | ``state.stats``          | 2**63 - 2            | the words (step 0)  |

The workload: step 0 prefills rows 1..3; every later step decodes them; step 2 also prefills row 4
with 300 tokens (two write blocks: the look-back carries the chain across them), which steps 3 and 4
decode and verify. A fault at step f is found at its step, with its exact reason, launch point and
slot; the clean twin reports nothing across the wraps. Without the marks' restart, a conflict after
it is missed (the marks of the launch before have the smallest key); the look-back's comparison is
checked on its own in ``tests/ops/test_wrap.py``."""

from __future__ import annotations

import pytest
import torch

from kvcanary.config import CanaryConfig
from kvcanary.core.record import CHAIN, Half, Reason, record_words
from kvcanary.ops.conflicts import EPOCH_LIMIT
from kvcanary.ops.fingerprint import FingerprintMode, KVSource
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.canary import Canary, PoolGeometry

NUM_SLOTS, ROWS, CTX, LONG = 400, 5, 320, 300
CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
INTERPRETED = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test (CUDA runs the kernel)")
# (device, fused): the CPU ops one by one, the compiled CPU kernel (or the torch path where none is
# built), the Triton kernel interpreted; on CUDA the fused kernel, the ops one by one (check_writes)
# and the fused kernel replayed from captured graphs (``eager_graphs``: the wraps happen inside replays)
PATHS = [pytest.param("cpu", False, id="cpu-ops"), pytest.param("cpu", None, id="cpu-kernel"),
         pytest.param("cpu", True, id="cpu-triton", marks=INTERPRETED),
         pytest.param("cuda", None, id="cuda-fused", marks=CUDA),
         pytest.param("cuda", False, id="cuda-ops", marks=CUDA),
         pytest.param("cuda", "graphs", id="cuda-graph-replay", marks=CUDA)]
WORKSPACE_WRAPS = [pytest.param(2**61 - 2, id="4epoch-wraps"), pytest.param(2**63 - 2, id="epoch-wraps")]
FAULTS = [pytest.param("write_conflict", 1, id="write-conflict-last-epoch"),
          pytest.param("write_conflict", 2, id="write-conflict-after-restart"),
          pytest.param("read_conflict", 2, id="read-conflict-after-restart"),
          pytest.param("rewrite_twice", 2, id="stale-writer-mark-after-restart"),
          pytest.param("write_conflict", 4, id="write-conflict-long-row"),
          pytest.param("chain", 3, id="chain-after-wrap")]
STEPS = 5
STATS_START = 2**63 - 2  # every stats word (launches, slots checked, slots stamped): wraps at the first step


def wrapped(v: int) -> int:
    """``v`` as an int64 word holds it."""
    return (v + 2**63) % 2**64 - 2**63


class World:
    """A canary on ``device`` and the workload of the module doc, step by step."""

    def __init__(self, device: str, fused: bool | str | None, seed: int = 3):
        self.device, self.gen = device, torch.Generator().manual_seed(seed)
        self.kv = torch.randn(NUM_SLOTS, 2, 16, generator=self.gen).to(device, torch.bfloat16)
        graphs = fused == "graphs"
        config = CanaryConfig(real_kv=FingerprintMode.PARTIAL, max_bs=4, max_tokens=LONG + 8, sweep_interval=0,
                              fused=None if graphs else fused, eager_graphs=graphs)
        # the Triton paths keep the marks' epoch; the fused kernel the workspaces' too
        self.uses_marks = device == "cuda" or fused is True
        self.uses_workspaces = self.uses_marks and fused is not False
        self.canary = Canary(config, PoolGeometry(NUM_SLOTS, ROWS, CTX, device),
                             sources=[KVSource.from_buffer(self.kv, half=Half.K)])
        self.free = (torch.randperm(NUM_SLOTS - 1, generator=self.gen) + 1).tolist()
        self.table = torch.zeros(ROWS, CTX, dtype=torch.int32)
        self.tokens: dict[int, list[int]] = {}

    def start_counters(self, workspace_epoch: int) -> None:
        self.canary.marks.set_epoch(EPOCH_LIMIT - 2)
        for ws in self.canary.state.workspaces:
            ws.set_epoch(workspace_epoch)
        self.canary.state.stats.fill_(STATS_START)

    def batch(self, step: int) -> dict[int, list[int]]:
        """The rows this step writes and their new slots."""
        if step == 0:
            rows = {1: 6, 2: 9, 3: 12}
        else:
            rows = {1: 1, 2: 1, 3: 1} | ({4: LONG} if step == 2 else {4: 1} if step > 2 else {})
        out = {}
        for row, n in rows.items():
            out[row], self.free = self.free[:n], self.free[n:]
        return out

    def forward(self, step: int, writes: dict[int, list[int]]) -> None:
        rows = sorted(writes)
        prefix = [len(self.tokens.get(r, [])) for r in rows]
        ids, pos, loc = [], [], []
        for r, p in zip(rows, prefix, strict=True):
            new = torch.randint(0, 30_000, (len(writes[r]),), generator=self.gen).tolist()
            self.table[r, p: p + len(new)] = torch.tensor(writes[r], dtype=torch.int32)
            self.tokens[r] = self.tokens.get(r, []) + new
            ids += new
            pos += list(range(p, p + len(new)))
            loc += writes[r]
        i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=self.device)  # noqa: E731
        b = ForwardBatch(i64(rows), i64(prefix), i64([len(writes[r]) for r in rows]), self.table.to(self.device),
                         i64(ids), i64(pos), i64(loc))
        with self.canary.forward(b):
            self.kv[b.out_cache_loc] = torch.randn(len(loc), 2, 16, generator=self.gen).to(self.device,
                                                                                           torch.bfloat16)

    def run(self, steps: int, fault: str | None = None) -> tuple[list, int | None]:
        """Steps 0..steps-1, the fault (if any) in the last; returns every violation read, and
        the fault's slot. No watchdog alarm fires (the launch counts wrap past 2**63)."""
        found, slot = [], None
        for step in range(steps):
            writes = self.batch(step)
            if fault is not None and step == steps - 1:
                slot = self.inject(fault, writes)
            self.forward(step, writes)
            report = self.canary.end_step(step)
            assert report.alarms == []
            found += report.violations
        return found + self.canary.flush(steps).violations, slot

    def inject(self, fault: str, writes: dict[int, list[int]]) -> int:
        if fault == "write_conflict":  # the last row writes its last token into the first row's new slot
            last = max(writes)
            writes[last][-1] = writes[1][0]
            return writes[1][0]
        if fault == "read_conflict":  # row 2 writes into a slot of row 1's prefix
            writes[2][0] = int(self.table[1, 2])
            return writes[2][0]
        if fault == "rewrite_twice":  # rows 2 and 3 write row 1's newest slot (written, so marked, a step ago)
            writes[2][0] = writes[3][0] = int(self.table[1, len(self.tokens[1]) - 1])
            return writes[2][0]
        slot = int(self.table[3, len(self.tokens[3]) - 1])  # chain: row 3's newest slot, read by this step
        record_words(self.canary.state.records)[slot, CHAIN] ^= 1 << 17
        return slot


def rows_of(found: list) -> list[tuple]:
    return sorted((v.step, v.point.name, v.slot, int(v.reasons), v.expected_value) for v in found)


@pytest.mark.parametrize("workspace_epoch", WORKSPACE_WRAPS)
@pytest.mark.parametrize(("device", "fused"), PATHS)
def test_the_clean_twin_runs_silent_across_every_wrap(device, fused, workspace_epoch):
    w = World(device, fused)
    w.start_counters(workspace_epoch)
    found, _ = w.run(STEPS)
    assert rows_of(found) == []
    assert w.canary.totals.violations == 0
    # five HEADs: EPOCH_LIMIT - 2, EPOCH_LIMIT - 1, then the restart: 0, 1, 2, and 3 next
    assert int(w.canary.marks.epoch[0]) == (3 if w.uses_marks else EPOCH_LIMIT - 2)
    for ws in w.canary.state.workspaces:
        assert int(ws.sync[3]) == wrapped(workspace_epoch + (STEPS if w.uses_workspaces else 0))
    launches = w.canary.state.stats[:, 0].tolist()  # HEAD's and TAIL's full-pool K tags launched 5 times
    assert sorted(launches) == sorted([wrapped(STATS_START + STEPS)] * 2 + [STATS_START] * (len(launches) - 2))


@pytest.mark.parametrize(("fault", "at"), FAULTS)
@pytest.mark.parametrize(("device", "fused"), PATHS)
def test_a_fault_across_the_wraps_is_found_at_its_step(device, fused, fault, at):
    w = World(device, fused)
    w.start_counters(2**61 - 2)
    found, slot = w.run(at + 1, fault)
    head = [r for r in rows_of(found) if r[1] == "HEAD"]
    if fault == "write_conflict":  # named at HEAD: the writer's row and the first writer's (row 1)
        assert head == [(at, "HEAD", slot, int(Reason.WRITE_CONFLICT), 1)]
        assert rows_of(found) == head
    elif fault == "read_conflict":  # row 2 writes a slot row 1 reads; TAIL then finds it and its successor broken
        assert head == [(at, "HEAD", slot, int(Reason.READ_CONFLICT), 1)]
        tail = [r for r in rows_of(found) if r[1] != "HEAD"]
        assert {(r[0], r[1], r[2]) for r in tail} == {(at, "TAIL", slot), (at, "TAIL", int(w.table[1, 3]))}
        assert len(tail) == 2
    elif fault == "rewrite_twice":  # both read conflicts (row 1 reads it), the second writer's a duplicate
        assert head == [(at, "HEAD", slot, int(Reason.READ_CONFLICT), 1),
                        (at, "HEAD", slot, int(Reason.WRITE_CONFLICT | Reason.READ_CONFLICT), 2)]
        assert {(r[0], r[1], r[2]) for r in rows_of(found) if r[1] != "HEAD"} == {(at, "TAIL", slot)}
    else:  # the damaged chain, at HEAD and again at TAIL, in its step
        assert [r[:4] for r in rows_of(found)] == [(at, "HEAD", slot, int(Reason.CHAIN)),
                                                    (at, "TAIL", slot, int(Reason.CHAIN))]
