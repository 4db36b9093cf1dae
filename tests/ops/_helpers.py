"""Shared plumbing of the op tests: backends and devices, random inputs, tensor <-> list views."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import strategies as st

from kvcanary.core.record import new_ring, new_stats, record_words
from kvcanary.ops._common import Backend
from kvcanary.ops._cpu import usable as numba_usable
from kvcanary.ops.fingerprint import KVSource
from kvcanary.ops.plan import Plan
from kvcanary.ops.state import DeviceState, Workspace

from . import reference as ref
from ._compare import assert_same

# Without CUDA the kernels run on CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py).
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = (Backend.TORCH, Backend.TRITON)
BACKEND_IDS = [b.value for b in BACKENDS]
# the ops with a compiled CPU kernel (check_forward, verify, scatter_req_token_ids) are checked on it too
WITH_NUMBA = (*BACKENDS, Backend.NUMBA) if numba_usable() else BACKENDS
WITH_NUMBA_IDS = [b.value for b in WITH_NUMBA]
SEEDS = st.integers(0, 2**32 - 1)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def device_for(backend: Backend) -> torch.device:
    return TRITON_DEVICE if backend is Backend.TRITON else torch.device("cpu")


def on_device(x, device: torch.device):
    """A copy of ``x`` (a tensor, Plan, KVSource or a list/tuple of them) on ``device``; other values as they are."""
    if isinstance(x, torch.Tensor):
        return x.to(device, copy=True)
    if isinstance(x, Plan):
        return type(x)(**{f.name: on_device(getattr(x, f.name), device) for f in dataclasses.fields(x)})
    if isinstance(x, KVSource):
        return dataclasses.replace(x, words=on_device(x.words, device))
    if isinstance(x, list | tuple):
        return type(x)(on_device(v, device) for v in x)
    return x


STATE_KEYS = ("canary", "ring", "ring_counter", "stats", "workspace", "source_tags")


def with_state(op, **kwargs):
    """Call ``op`` with the loose buffers a test built (``canary``, ``ring``, ``ring_counter``,
    ``stats``, ``workspace``, ``source_tags``) wrapped in one DeviceState sharing their storage; a
    missing ring, stats or side words are allocated. Without a ``canary`` the arguments pass through unchanged."""
    if "canary" not in kwargs:
        return op(**kwargs)
    loose = {k: kwargs.pop(k) for k in STATE_KEYS if k in kwargs}
    canary = loose["canary"]
    dev = canary.device if isinstance(canary, torch.Tensor) else torch.device("cpu")
    ring, counter = (loose.get("ring"), loose.get("ring_counter"))
    if ring is None or counter is None:
        fresh_ring, fresh_counter = new_ring(4, dev)
        ring = fresh_ring if ring is None else ring
        counter = fresh_counter if counter is None else counter
    stats = loose["stats"] if loose.get("stats") is not None else new_stats(dev)
    workspaces = ()
    if loose.get("workspace") is not None:
        spare = Workspace.allocate(1, 1, dev)
        workspaces = (loose["workspace"], spare) if kwargs.get("stamp") else (spare, loose["workspace"])
    return op(state=DeviceState(canary, ring, counter, stats, workspaces=workspaces,
                                source_tags=loose.get("source_tags")), **kwargs)


def run_op(op, backend: Backend, **kwargs):
    """Call ``op`` on copies of ``kwargs`` placed for ``backend``; returns (the copies, op's result).
    Loose state buffers in ``kwargs`` go to the op as one DeviceState (``with_state``)."""
    args = {k: on_device(v, device_for(backend)) for k, v in kwargs.items()}
    return args, with_state(op, **args, backend=backend)


# --- random values ---------------------------------------------------------------------------

def token_ids(gen: torch.Generator, n: int, lo: int = INT64_MIN, hi: int = INT64_MAX, vocab: int = 50_000
              ) -> torch.Tensor:
    """int64[n]: mostly small ids in [1, vocab), a fifth anywhere in [lo, hi], both ends included."""
    small = torch.randint(1, vocab, (n,), generator=gen)
    wide = torch.randint(lo, hi, (n,), generator=gen)
    wide = torch.where(torch.rand(n, generator=gen) < 0.1, torch.tensor([lo, hi])[torch.arange(n) % 2], wide)
    return torch.where(torch.rand(n, generator=gen) < 0.2, wide, small)


def random_canary(gen: torch.Generator, num_slots: int) -> torch.Tensor:
    """uint8[num_slots, 32] of random bytes (never a zeroed buffer: untouched records must stay as they were)."""
    return torch.randint(0, 256, (num_slots, 32), dtype=torch.uint8, generator=gen)


def random_tags(gen: torch.Generator, num_slots: int) -> torch.Tensor:
    """int64[num_slots] random side words (so "left as they were" is observable)."""
    return torch.randint(INT64_MIN, INT64_MAX, (num_slots,), dtype=torch.int64, generator=gen)


def damage_sources(gen: torch.Generator, sources: list[KVSource], num_slots: int, rate: float) -> None:
    """Flip one bit of the first word of a fraction ``rate`` of the slots, in one random source
    each (in place): parts of the fingerprint then differ from the side word."""
    for s in range(1, num_slots):
        if sources and float(torch.rand(1, generator=gen)) < rate:
            src = sources[int(torch.randint(0, len(sources), (1,), generator=gen))]
            at = (s // src.page_size) * src.page_stride // 4 + (s % src.page_size) * src.bytes_per_token // 4
            src.words[at] ^= 1 << int(torch.randint(0, 31, (1,), generator=gen))


# --- list views ------------------------------------------------------------------------------

def words_of(canary: torch.Tensor) -> list[list[int]]:
    return record_words(canary.cpu()).tolist()


def canary_of(words: list[list[int]]) -> torch.Tensor:
    return torch.tensor(words, dtype=torch.int64).view(torch.uint8).reshape(len(words), 32)


def plan_lists(plan: Plan) -> dict[str, list[int]]:
    return {name: getattr(plan, name).cpu().tolist() for name in ref.PLAN_FIELDS}


def plan_of(fields: dict[str, list[int]]) -> Plan:
    """A Plan holding ``fields`` (dict of lists, as ``plan_lists`` gives) with the dtypes of Plan.allocate."""
    proto = Plan.allocate(1, 1)
    return Plan(**{k: torch.tensor(v, dtype=getattr(proto, k).dtype) for k, v in fields.items()})


def random_plan(gen: torch.Generator, capacity: int, max_bs: int) -> Plan:
    """A plan whose buffers hold random values (so "left as they were" is observable)."""
    proto = Plan.allocate(capacity, max_bs)
    out = {}
    for f in dataclasses.fields(proto):
        t = getattr(proto, f.name)
        out[f.name] = torch.randint(-50, 1000, t.shape, generator=gen).to(t.dtype)
    out["overflow"] = torch.randint(0, 5, (1,), generator=gen)
    return Plan(**out)


def ring_rows(ring: torch.Tensor, counter: torch.Tensor) -> list[list[int]]:
    """The filled rows of a ring, sorted (row order is unspecified)."""
    n = min(int(counter[0]), ring.shape[0])
    return sorted(ring[:n].cpu().tolist())


def strided(x: torch.Tensor) -> torch.Tensor:
    """A non-contiguous view with the values of ``x``: every element of the last dim is followed by a junk one."""
    return torch.stack([x, torch.full_like(x, 7)], dim=-1)[..., 0]


def wide(x: torch.Tensor, extra: int = 3) -> torch.Tensor:
    """A view of 2-D ``x`` inside a wider buffer: unit column stride, row stride ``x.shape[1] + extra``."""
    big = torch.full((x.shape[0], x.shape[1] + extra), 7, dtype=x.dtype, device=x.device)
    big[:, : x.shape[1]] = x
    return big[:, : x.shape[1]]


def assert_ring(name: str, ring: torch.Tensor, counter: torch.Tensor, ring0: torch.Tensor, count0: int,
                want_rows: list[list[int]]) -> None:
    """The ring after one launch that started at ``count0`` with ``ring0``: the counter grew by every
    violation; the new rows fill [count0, capacity) in any order (the expected ones, or a subset when
    the ring overflowed); nothing else changed."""
    cap = ring0.shape[0]
    total = count0 + len(want_rows)
    assert counter.tolist() == [total], f"{name}: counter {counter.tolist()} != [{total}]"
    kept = max(min(cap, total) - count0, 0)
    got = ring[count0: count0 + kept].cpu().tolist() if kept else []
    if kept == len(want_rows):
        assert_same(f"{name} rows", sorted(got), sorted(want_rows))
    else:
        pool = sorted(want_rows)
        for row in got:
            assert row in pool, f"{name}: ring row {row} is not an expected violation"
            pool.remove(row)
    untouched = torch.ones(cap, dtype=torch.bool)
    untouched[count0: count0 + kept] = False
    assert_same(f"{name} untouched rows", ring.cpu()[untouched], ring0[untouched])
