"""publish_counters (the in-graph counter publication): kernel, torch path and reference agree
on every row and the sequence word, call after call, the ring wrapping around; so does the
kernel's bound launch (``BoundPublish``), its buffers keyed once and the block rewritten in place."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcanary.ops._common import HAS_TRITON, Backend
from kvcanary.ops.publish import BoundPublish, publish_counters

from ._compare import assert_same
from ._helpers import BACKEND_IDS, BACKENDS, INT64_MAX, INT64_MIN, SEEDS, device_for


def reference(blocks: list[list[int]], rows: list[list[int]], seq: int) -> tuple[list[list[int]], int]:
    """Each block in turn: seq += 1; rows[seq % K] = [seq, *block]."""
    rows = [list(r) for r in rows]
    for block in blocks:
        seq += 1
        rows[seq % len(rows)] = [seq, *block]
    return rows, seq


def _run(backend: Backend, blocks: torch.Tensor, rows: torch.Tensor, seq: int):
    if backend is Backend.TRITON and not HAS_TRITON:
        pytest.skip("triton is not installed")
    dev = device_for(backend)
    host = rows.clone().pin_memory() if dev.type == "cuda" else rows.clone()
    counter = torch.tensor([seq], dtype=torch.int64, device=dev)
    for block in blocks:
        publish_counters(block.to(dev), counter, host, triton_path=backend is Backend.TRITON)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return host, int(counter[0])


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@given(seed=SEEDS, width=st.integers(1, 40), num_rows=st.integers(1, 9), calls=st.integers(1, 12),
       start=st.integers(0, 2**40))
def test_matches_reference(backend, seed, width, num_rows, calls, start):
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(INT64_MIN, INT64_MAX, (calls, width), generator=gen)
    rows = torch.randint(INT64_MIN, INT64_MAX, (num_rows, width + 1), generator=gen)
    want_rows, want_seq = reference(blocks.tolist(), rows.tolist(), start)
    got_rows, got_seq = _run(backend, blocks, rows, start)
    assert_same(f"rows [{backend.value}]", got_rows, want_rows)
    assert got_seq == want_seq


@given(seed=SEEDS, width=st.integers(1, 40), num_rows=st.integers(1, 9), calls=st.integers(1, 12),
       start=st.integers(0, 2**40))
def test_bound_launch_matches_reference(seed, width, num_rows, calls, start):
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(INT64_MIN, INT64_MAX, (calls, width), generator=gen)
    rows = torch.randint(INT64_MIN, INT64_MAX, (num_rows, width + 1), generator=gen)
    want_rows, want_seq = reference(blocks.tolist(), rows.tolist(), start)
    dev = device_for(Backend.TRITON)
    host = rows.clone().pin_memory() if dev.type == "cuda" else rows.clone()
    block = torch.empty(width, dtype=torch.int64, device=dev)
    counter = torch.tensor([start], dtype=torch.int64, device=dev)
    publish = BoundPublish(block, counter, host)
    for b in blocks:
        block.copy_(b)  # the same buffer each call, as the counter block is
        publish()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    assert_same("rows [bound]", host, want_rows)
    assert int(counter[0]) == want_seq


@pytest.mark.skipif(torch.cuda.is_available() or not HAS_TRITON, reason="observes the kernel's stores under the "
                    "Triton interpreter (no CUDA)")
@pytest.mark.parametrize("bound", [False, True], ids=["launch", "bound"])
def test_the_kernel_stores_the_sequence_word_after_every_block_word(bound, monkeypatch):
    """A host that reads ``rows[k, 0] == s`` takes the row as publication ``s``, so the kernel must
    store every block word before the sequence word (on CUDA with a fence between). Under the
    interpreter each ``tl.store`` runs in program order: every store's addresses are recorded."""
    from triton.runtime import interpreter

    stores: list[set[int]] = []
    store = interpreter.interpreter_builder.create_masked_store

    def recording(ptrs, value, mask, cache_policy):
        stores.append({int(a) for a in ptrs.data[mask.data.astype(bool)].reshape(-1).tolist()})
        return store(ptrs, value, mask, cache_policy)

    monkeypatch.setattr(interpreter.interpreter_builder, "create_masked_store", recording)
    width, num_rows, start = 5, 3, 7
    block = torch.arange(11, 11 + width, dtype=torch.int64)
    rows = torch.full((num_rows, width + 1), -1, dtype=torch.int64)
    seq = torch.tensor([start], dtype=torch.int64)
    if bound:
        BoundPublish(block, seq, rows)()
    else:
        publish_counters(block, seq, rows, triton_path=True)
    k = (start + 1) % num_rows
    assert rows[k].tolist() == [start + 1, *block.tolist()] and int(seq[0]) == start + 1
    seq_word = rows[k].data_ptr()
    block_words = {seq_word + 8 * (1 + i) for i in range(width)}
    order = [i for i, addresses in enumerate(stores) if seq_word in addresses]
    assert len(order) == 1, f"the sequence word was stored {len(order)} times"
    last_block = max(i for i, addresses in enumerate(stores) if addresses & block_words)
    assert set().union(*stores[: order[0]]) >= block_words, "a block word was stored after the sequence word"
    assert last_block < order[0]
