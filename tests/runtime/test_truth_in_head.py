"""Where HEAD is the Triton launch (CUDA; on the CPU, ``fused=True`` under the interpreter), a
batch's token truth, whole histories or appends, goes into its eager HEAD's own launch: no
scatter launch of its own, the same truth table and lengths as the op-by-op CPU path, and the
same violations. A HEAD ``prepare_head`` was not told is eager (a captured forward) appends in
a launch of its own, ahead of its checks."""

from __future__ import annotations

import pytest
import torch

import kvcanary.runtime.forward as forward_module
from kvcanary.config import CanaryConfig, Policy
from kvcanary.core.record import Reason
from kvcanary.ops._common import HAS_TRITON
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.canary import Canary, PoolGeometry

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ROWS, CTX, PROMPT = 5, 24, 4
REQUESTS = torch.tensor([1, 2, 3])
TABLE = (torch.arange(ROWS * CTX, dtype=torch.int32) + 1).view(ROWS, CTX)


def _canary(device: str, fused: bool) -> Canary:
    cfg = CanaryConfig(policy=Policy.LOG, max_bs=4, max_tokens=64, sweep_interval=0, fused=fused)
    return Canary(cfg, PoolGeometry(num_slots=ROWS * CTX + 1, rows=ROWS, max_ctx=CTX, device=device))


def _batch(device: str, tokens: torch.Tensor, told: torch.Tensor, step: int) -> ForwardBatch:
    """Step 0: each request's prompt (``PROMPT`` tokens, whole histories); step s > 0: its token
    at position ``PROMPT + s - 1`` (one append a request, from that column). ``told``: the
    history the batch's truth carries, ``tokens``: what the forward writes."""
    prefix, extend = (0, PROMPT) if step == 0 else (PROMPT + step - 1, 1)
    pos = torch.arange(prefix, prefix + extend).repeat(len(REQUESTS))
    row_of = REQUESTS.repeat_interleave(extend)
    if step == 0:
        truth = dict(truth_ids=told[REQUESTS, :PROMPT].reshape(-1).contiguous(),
                     truth_offsets=torch.arange(0, len(REQUESTS) * PROMPT + 1, PROMPT))
    else:
        truth = dict(truth_ids=told[REQUESTS, prefix].contiguous(), truth_offsets=torch.arange(len(REQUESTS) + 1),
                     truth_starts=torch.full((len(REQUESTS),), prefix))
    b = dict(req_pool_indices=REQUESTS, prefix_lens=torch.full((len(REQUESTS),), prefix),
             extend_lens=torch.full((len(REQUESTS),), extend), req_to_token=TABLE, input_ids=tokens[row_of, pos],
             positions=pos, out_cache_loc=TABLE[row_of, pos].long(), **truth)
    return ForwardBatch(**{k: v.to(device) for k, v in b.items()})


def _scatter_launches(monkeypatch) -> list:
    """The canary's own truth scatters (not a HEAD's), launched or through the op, counted from here on."""
    launches = []

    def counted(op):
        return lambda *a, **k: (launches.append(1), op(*a, **k))[1]

    for name in ("scatter_validated", "scatter_req_token_ids"):
        monkeypatch.setattr(forward_module, name, counted(getattr(forward_module, name)))
    return launches


def _run(canary: Canary, device: str, tokens: torch.Tensor, damaged: bool, eager: bool = True) -> set:
    """Six steps (a prompt, then five appends); with ``damaged``, step 3's append for row 2 tells
    another token than the one its forward writes. Returns every violation as (step, launch
    point, slot, reasons)."""
    found = set()
    for step in range(6):
        told = tokens.clone()
        if damaged and step == 3:
            told[2, PROMPT + 2] += 1
        b = _batch(device, tokens, told, step)
        canary.prepare_head(b, eager=eager)
        canary.launch_head(b)
        canary.tail(b)
        found |= {(v.step, v.point.name, v.slot, v.reasons) for v in canary.end_step(step).violations}
    found |= {(v.step, v.point.name, v.slot, v.reasons) for v in canary.flush(6).violations}
    return found


@pytest.mark.parametrize("damaged", [False, True])
def test_an_eager_head_takes_whole_histories_and_appends_into_its_launch(monkeypatch, damaged):
    gen = torch.Generator().manual_seed(21)
    tokens = torch.randint(1, 50_000, (ROWS, CTX), generator=gen)
    got, want = _canary(DEV, fused=True), _canary("cpu", fused=False)  # op by op: prepare_head scatters
    launches = _scatter_launches(monkeypatch)
    found = _run(got, DEV, tokens, damaged)
    assert launches == []
    assert _run(want, "cpu", tokens, damaged) == found
    assert torch.equal(got.truth.cpu(), want.truth) and torch.equal(got.truth_lens.cpu(), want.truth_lens)
    assert got.truth_lens.cpu().tolist()[:3] == [PROMPT + 5] * 3
    slot = int(TABLE[2, PROMPT + 2])  # row 2's token at PROMPT + 2, written at step 3
    want_found = {(3, "HEAD", slot, Reason.WRITE_TOKEN)} | {(s, p, slot, Reason.VERIFY_TOKEN)
                                                            for s in (4, 5) for p in ("HEAD", "TAIL")}
    assert found == (want_found if damaged else set())


def test_a_head_not_told_it_is_eager_appends_in_a_launch_of_its_own(monkeypatch):
    gen = torch.Generator().manual_seed(22)
    tokens = torch.randint(1, 50_000, (ROWS, CTX), generator=gen)
    got, want = _canary(DEV, fused=True), _canary("cpu", fused=False)
    launches = _scatter_launches(monkeypatch)
    assert _run(got, DEV, tokens, False, eager=False) == set()
    assert len(launches) == 6  # the prompt's histories, then one launch per step's appends
    assert _run(want, "cpu", tokens, False) == set()
    assert torch.equal(got.truth.cpu(), want.truth) and torch.equal(got.truth_lens.cpu(), want.truth_lens)
