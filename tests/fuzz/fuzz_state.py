"""Fuzz mutated internal state: valid built objects, changed behind the ops' backs, then used.

A case builds a small random world (a ``DeviceState`` with its workspaces, a ``Plan`` filled by
``build_plan``, ``WriteMarks``, KV sources and their ``SourceSet``) and the bound launches over
it, then mutates one buffer or one object in place, the way a buggy caller or a stale reference
would: resize it, swap two fields of a frozen object, restride it at the same address, misalign
it through an offset view, give it another dtype, or change a source's geometry (a move to
another device is not made: torch refuses ``.data`` across device types, and a CPU-only run has
no other device with data). It then calls an op (or a bound launch) that reads the mutated object:

- the call must raise one of our errors (InputError and its subclasses), never a raw exception,
  a crash or an access out of bounds, and leave every byte of every storage involved (the
  mutated tensors' old and new storages included) as it was;
- the ops' backends (torch, the Triton kernel interpreted on CPU, and the compiled CPU kernel
  where the op has one) must raise the same error type with the same message;
- the unmutated twin of a case (one in eight) must run on every backend: the family exercises
  paths that work, not only refusals;
- ``BoundForward`` (the compiled CPU path's per-step launch) reads only the memory it was bound
  to and holds it, so a mutation behind its back must not reach it: the mutated case runs and
  leaves every storage bound before the mutation byte for byte as its unmutated twin's run
  does, and every storage the mutation brought in untouched.

``python tests/fuzz/fuzz_state.py --cases N`` prints the counts.
"""

from __future__ import annotations

import random
import time
from collections import Counter

import torch

from kvcanary.core.record import NUM_LAUNCH_TAGS
from kvcanary.errors import InputError
from kvcanary.ops import (
    Backend,
    BoundCheck,
    BoundMarks,
    BoundVerify,
    DeviceState,
    FingerprintMode,
    KVSource,
    Plan,
    SourceSet,
    build_plan,
    check_forward,
    check_writes,
    check_writes_landed,
    fingerprint,
    mark_writes,
    stamp,
    verify,
)
from kvcanary.ops.backend import BoundForward, batch_arrays
from kvcanary.ops.backend import cpu_kernels_usable as numba_usable
from kvcanary.ops.conflicts import WriteMarks

MUTATIONS = ("resize", "swap", "restride", "misalign", "dtype", "geometry")
OPS = ("verify", "build_plan", "check_writes", "stamp", "fingerprint", "mark_writes", "check_writes_landed",
       "check_forward", "BoundCheck", "BoundVerify", "BoundMarks", "BoundForward")
NUMBA_OPS = ("verify", "check_forward")
# the objects each op reads, so that a mutation of one of them is seen by the op
READS = {"verify": ("state", "plan", "sources"), "build_plan": ("plan",), "check_writes": ("state", "plan", "marks"),
         "stamp": ("state",), "fingerprint": ("state", "sources"), "mark_writes": ("state", "sources"),
         "check_writes_landed": ("state", "sources"), "check_forward": ("state", "workspace", "marks", "sources"),
         "BoundCheck": ("state", "workspace", "marks", "sources"), "BoundVerify": ("state", "plan", "sources"),
         "BoundMarks": ("state", "sources"), "BoundForward": ("state", "sources")}
STATE_FIELDS = ("records", "ring", "ring_counter", "stats", "error", "source_tags")
WS_FIELDS = ("sync", "write_offsets", "seed", "block_sum", "block_flag")
PLAN_FIELDS = ("slot", "pred", "position", "token", "count", "enable", "overflow", "verify_offsets", "write_offsets",
               "seed", "entry", "row")


class World:
    """One case's built objects, random content (never zeros), tiny shapes."""

    def __init__(self, rng: random.Random):
        self.gen = g = torch.Generator().manual_seed(rng.getrandbits(32))
        self.num_slots = n = rng.choice([5, 9, 17])
        bs = rng.choice([1, 2, 3])
        self.state = DeviceState.allocate(n, ring_capacity=rng.choice([4, 16]), max_bs=4, max_tokens=8)
        self.state.records.copy_(torch.randint(0, 256, self.state.records.shape, dtype=torch.uint8, generator=g))
        self.state.source_tags.copy_(torch.randint(-(2**40), 2**40, (n,), generator=g))
        max_ctx = 4
        self.rtt = torch.randint(1, n, (bs + 1, max_ctx), dtype=torch.int32, generator=g)
        self.rpi = torch.arange(1, bs + 1)
        self.prefix = torch.randint(0, 3, (bs,), generator=g)
        self.extend = torch.ones(bs, dtype=torch.int64)
        slots = torch.randperm(n - 1, generator=g)[:bs] + 1
        self.loc = slots.to(torch.int64)
        for r in range(bs):
            self.rtt[r + 1, int(self.prefix[r])] = int(slots[r])
        self.ids = torch.randint(1, 50_000, (bs,), generator=g)
        self.pos = self.prefix.clone()
        self.plan = Plan.allocate(rng.choice([4, 12]), 4)
        build_plan(req_pool_indices=self.rpi, prefix_lens=self.prefix, extend_lens=self.extend, req_to_token=self.rtt,
                   plan=self.plan, backend=Backend.TORCH)
        self.marks = WriteMarks.allocate(n)
        self.mode = rng.choice([FingerprintMode.PARTIAL, FingerprintMode.ALL])
        self.sources = [KVSource.from_buffer(torch.randint(-(2**31), 2**31 - 1, (n, rng.choice([4, 8])),
                                                           dtype=torch.int32, generator=g))
                        for _ in range(rng.choice([1, 2]))]
        self.kv = SourceSet.build(self.sources, self.mode, n, self.state.device)
        self.tag = rng.randrange(NUM_LAUNCH_TAGS)

    def targets(self, op: str) -> list[tuple[str, object, str]]:
        """(name, owner, field) of every tensor ``op`` reads; owner None: a tensor held directly."""
        out = []
        reads = READS[op]
        if "state" in reads:
            out += [(f"state.{f}", self.state, f) for f in STATE_FIELDS]
        if "workspace" in reads:
            ws = self.state.workspaces[0]
            out += [(f"workspace.{f}", ws, f) for f in WS_FIELDS]
        if "plan" in reads:
            out += [(f"plan.{f}", self.plan, f) for f in PLAN_FIELDS]
        if "marks" in reads:
            out += [("marks.words", self.marks, "words"), ("marks.epoch", self.marks, "epoch")]
        if "sources" in reads:
            out += [(f"sources[{i}].words", s, "words") for i, s in enumerate(self.sources)]
        return out

    def storages(self) -> list[torch.Tensor]:
        """Every tensor of the world (each a view of its storage, held so its memory stays)."""
        ts = [getattr(self.state, f) for f in STATE_FIELDS]
        ts += [t for ws in self.state.workspaces for t in ws.tensors()]
        ts += [getattr(self.plan, f) for f in PLAN_FIELDS] + [self.marks.words, self.marks.epoch]
        ts += [s.words for s in self.sources] + [self.kv.meta]
        return ts


def mutate(w: World, rng: random.Random, op: str) -> str:
    """Mutate one tensor or object ``op`` reads; returns what was done."""
    kind = rng.choice(MUTATIONS)
    if kind == "geometry" and "sources" not in READS[op]:
        kind = "resize"
    if kind == "geometry":
        src = rng.choice(w.sources)
        name = rng.choice(("num_slots", "page_size", "bytes_per_token", "page_stride_bytes", "resize"))
        if name == "resize":
            src.words.resize_(max(src.words.shape[0] // 2, 1))
        else:
            object.__setattr__(src, name, getattr(src, name) * 2 + 16 * (name == "page_stride_bytes"))
        return f"geometry {name}"
    if kind == "swap" and "sources" in READS[op] and len(w.sources) > 1 and rng.random() < 0.25:
        a, b = rng.sample(w.sources, 2)  # two sources' words traded: each its geometry, the other's buffer
        wa, wb = a.words, b.words
        object.__setattr__(a, "words", wb)
        object.__setattr__(b, "words", wa)
        return "swap KVSource.words"
    if kind == "swap":
        owner = rng.choice([o for o, r in ((w.state, "state"), (w.plan, "plan"), (w.state.workspaces[0], "workspace"),
                                           (w.marks, "marks")) if r in READS[op]] or [w.state])
        fields = {DeviceState: STATE_FIELDS, Plan: PLAN_FIELDS, WriteMarks: ("words", "epoch")}.get(type(owner),
                                                                                                   WS_FIELDS)
        a, b = rng.sample(fields, 2)
        ta, tb = getattr(owner, a), getattr(owner, b)
        object.__setattr__(owner, a, tb)
        object.__setattr__(owner, b, ta)
        return f"swap {type(owner).__name__}.{a} {b}"
    name, owner, field = rng.choice(w.targets(op))
    t = getattr(owner, field)
    if kind == "resize" and t.untyped_storage().resizable():
        t.resize_(*((max(t.shape[0] + rng.choice([-1, 1, 3]), 0),) + tuple(t.shape[1:])))
    elif kind == "resize":  # a storage numpy views (the compiled CPU path's): a shorter view of it
        t.set_(t.untyped_storage(), t.storage_offset(), (max(t.shape[0] - 1, 0),) + tuple(t.shape[1:]), t.stride())
    elif kind == "restride":
        if t.dim() == 2 and t.shape[0] > 1:  # the same address, another row stride (a transposed read)
            t.as_strided_(t.shape, (1, t.shape[0]))
        else:  # one element repeated: every index reads the first word
            t.as_strided_(t.shape, (0,) * t.dim())
    elif kind == "misalign":
        # the same bytes one word further on, in a buffer of their own: records 1 byte off an 8-byte word,
        # any other buffer one element off its former place (KV words lose their 16-byte alignment)
        step = 1 if t.dtype == torch.uint8 else t.element_size()
        buf = torch.empty(t.numel() * t.element_size() + 64, dtype=torch.uint8)
        off = (-buf.data_ptr()) % 64 + step
        t.set_(buf.untyped_storage(), off // t.element_size(), t.shape, t.stride())
    else:  # another dtype of the same size over the same bytes
        other = {torch.int64: torch.float64, torch.int32: torch.float32, torch.uint8: torch.int8}[t.dtype]
        t.data = t.view(other)
    return f"{kind} {name}"


def _bound(w: World, op: str):
    """The bound launch of ``op`` over the world, built before any mutation."""
    if op == "BoundCheck":
        return BoundCheck(w.state, stamp=True, sources=w.kv, marks=w.marks)
    if op == "BoundVerify":
        return BoundVerify(w.state, w.plan, w.kv)
    if op == "BoundForward":  # the compiled CPU path's per-step launch (a CPU Canary's)
        truth = torch.randint(1, 50_000, w.rtt.shape, dtype=torch.int32, generator=w.gen)
        return BoundForward(w.state, w.kv.list(), w.kv.meta, truth, torch.zeros(w.rtt.shape[0], dtype=torch.int64),
                            0, 8)
    return BoundMarks(w.state, w.sources, w.kv.meta, w.mode)


def call(w: World, op: str, bound, backend: Backend) -> None:
    s, kv = w.state, w.kv
    batch = dict(req_pool_indices=w.rpi, prefix_lens=w.prefix, extend_lens=w.extend, req_to_token=w.rtt)
    if op == "BoundCheck":
        bound(w.rpi, w.prefix, w.extend, w.rtt, w.ids, w.pos, w.loc, tag=w.tag)
    elif op == "BoundVerify":
        bound(w.tag)
    elif op == "BoundMarks":
        bound(w.loc)
    elif op == "BoundForward":
        arrays = batch_arrays(w.rpi, w.prefix, w.extend, w.rtt, w.ids, w.pos, w.loc, None)
        if not bound.check(arrays, None, w.tag, True, False):
            raise AssertionError("BoundForward refused a valid batch without an error")
    elif op == "verify":
        verify(state=s, plan=w.plan, tag=w.tag, sources=kv, backend=backend)
    elif op == "build_plan":
        build_plan(**batch, plan=w.plan, backend=backend)
    elif op == "check_writes":
        check_writes(state=s, plan=w.plan, out_cache_loc=w.loc, input_ids=w.ids, positions=w.pos,
                     req_pool_indices=w.rpi, write_offsets=w.plan.write_offsets[: w.rpi.shape[0] + 1], tag=w.tag,
                     marks=w.marks, backend=backend)
    elif op == "stamp":
        stamp(state=s, out_cache_loc=w.loc, input_ids=w.ids, positions=w.pos, req_pool_indices=w.rpi,
              prefix_lens=w.prefix, write_offsets=torch.arange(w.rpi.shape[0] + 1),
              seed=torch.full((w.rpi.shape[0],), -1), tag=w.tag, backend=backend)
    elif op == "fingerprint":
        fingerprint(slots=w.loc, sources=kv, mode=w.mode, state=s, record=True, backend=backend)
    elif op == "mark_writes":
        mark_writes(state=s, out_cache_loc=w.loc, sources=w.sources, mode=w.mode, backend=backend)
    elif op == "check_writes_landed":
        check_writes_landed(state=s, out_cache_loc=w.loc, input_ids=w.ids, positions=w.pos, sources=w.sources,
                            tag=w.tag, backend=backend)
    else:
        check_forward(state=s, **batch, input_ids=w.ids, positions=w.pos, out_cache_loc=w.loc, tag=w.tag, stamp=True,
                      sources=kv, marks=w.marks, backend=backend)


def _bytes(ts: list) -> list[torch.Tensor | None]:
    """A copy of every byte of each tensor's storage, or each storage's (None for the meta device)."""
    out = []
    for t in ts:
        st = t.untyped_storage() if isinstance(t, torch.Tensor) else t
        if st.device.type == "meta":
            out.append(None)
            continue
        out.append(torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,)).clone())
    return out


def run_one(seed: int, backend: Backend, twin: bool = False) -> tuple[str, str, BaseException | None, bool, list]:
    """(op, mutation or 'none', the error raised or None, whether the storages kept their bytes,
    the bytes of the storages as built after the call). ``twin``: the case without its mutation.
    Kept: every storage (for ``BoundForward``, which writes the memory it was bound to: every
    storage the mutation brought in)."""
    rng = random.Random(seed)
    op = rng.choice(OPS)
    w = World(rng)
    bound = _bound(w, op) if op.startswith("Bound") else None
    built = w.storages()  # the storages before the mutation: a stale view must not be written either
    memory = [t.untyped_storage() for t in built]  # what they are now, whatever the mutation does to them
    mutated = rng.random() >= 1 / 8 and not twin
    what = mutate(w, rng, op) if mutated else "none"
    held = built + w.storages()
    if op == "BoundForward":
        bound_to = {t.untyped_storage().data_ptr() for t in built}
        held = [t for t in w.storages() if t.untyped_storage().data_ptr() not in bound_to]
    before = _bytes(held)
    err = None
    try:
        call(w, op, bound, backend)
    except Exception as e:  # noqa: BLE001 - classified by the caller
        err = e
    kept = all(b is None or torch.equal(b, a) for b, a in zip(before, _bytes(held), strict=True))
    return op, what, err, kept, _bytes(memory)


def unaffected(seed: int) -> tuple[str, str | None]:
    """A ``BoundForward`` case (module doc): (outcome, problem)."""
    op, what, err, kept, after = run_one(seed, Backend.NUMBA)
    label = f"{op} [{what}]"
    if err is not None:
        return "problem", f"{label}: raised {type(err).__name__}: {err}"
    if what == "none":
        return "ok", None
    if not kept:
        return "problem", f"{label}: wrote to a storage the mutation brought in"
    twin = run_one(seed, Backend.NUMBA, twin=True)[4]
    if not all(torch.equal(a, b) for a, b in zip(after, twin, strict=True)):
        return "problem", f"{label}: the mutation changed what it wrote"
    return "unaffected", None


def compare(seed: int) -> tuple[str, str, str | None]:
    """(op, outcome, problem): outcome 'ok', 'refused' or 'problem'; problem None when the case
    holds every promise of the module doc."""
    op = random.Random(seed).choice(OPS)
    if op == "BoundForward":
        return (op, "skipped", None) if not numba_usable() else (op, *unaffected(seed))
    backends = [Backend.TRITON] if op.startswith("Bound") else [Backend.TORCH, Backend.TRITON]
    if op in NUMBA_OPS and numba_usable():
        backends.append(Backend.NUMBA)
    runs = {b: run_one(seed, b) for b in backends}
    outcomes = {}
    for b, (_, what, err, kept, _) in runs.items():
        label = f"{op} [{what}] on {b.value}"
        if what == "none":
            if err is not None:
                return op, "problem", f"{label}: the unmutated twin raised {type(err).__name__}: {err}"
        elif err is None:
            return op, "problem", f"{label}: accepted"
        elif not isinstance(err, InputError):
            return op, "problem", f"{label}: raw {type(err).__name__}: {err}"
        elif not kept:
            return op, "problem", f"{label}: bytes changed before the error {err}"
        outcomes[b] = (type(err), str(err)) if err is not None else None
    if len(set(outcomes.values())) > 1:
        return op, "problem", f"{op} [{runs[backends[0]][1]}]: backends disagree: {outcomes}"
    return op, "ok" if runs[backends[0]][1] == "none" else "refused", None


def fuzz(seeds, counts: Counter | None = None) -> list[str]:
    counts = Counter() if counts is None else counts
    problems = []
    for seed in seeds:
        op, outcome, problem = compare(seed)
        counts[op, outcome] += 1
        if problem is not None:
            problems.append(f"seed {seed}: {problem}")
    return problems


if __name__ == "__main__":  # pragma: no cover - the published counts
    import argparse
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    p = argparse.ArgumentParser()
    p.add_argument("--cases", type=int, default=300)
    args = p.parse_args()
    counts, t0 = Counter(), time.perf_counter()
    problems = fuzz(range(args.cases), counts)
    for key, v in sorted(counts.items()):
        print(key, v)
    print(f"{args.cases} cases, {len(problems)} problems, {time.perf_counter() - t0:.0f} s")
    for line in problems[:40]:
        print(" ", line)
