"""Fuzz every public op on its backends: random valid inputs, then adversarial mutations.

Every tensor lives in the middle of a larger buffer of random guard bytes (an ``Arena``); the op
gets the view. One case is generated twice from its seed (one copy per backend) and run:

- an error must be one of ours (InputError / InputTypeError, a KVCanaryError) and leave every
  buffer exactly as it was (raised before any state was written);
- a success must leave every guard byte as it was, and both backends must succeed and agree
  byte for byte (ring rows as a multiset: their order is unspecified);
- both backends must give the same outcome (the same error, or success).

The ops with a compiled CPU kernel (``check_forward``, ``verify``, ``scatter_req_token_ids``) run a
third copy on it (``Backend.NUMBA``, where numba serves), held to the same promises against the
torch path: numba does not check bounds, so its guard bytes are the out-of-bounds test.

``python tests/fuzz/fuzz_ops.py --cases N`` prints the counts (cases, errors by type, mismatches).
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections import Counter
from collections.abc import Callable

import torch

from kvcanary.core.record import NUM_LAUNCH_TAGS, NUM_STATS
from kvcanary.errors import InputError
from kvcanary.ops._common import Backend
from kvcanary.ops._cpu import usable as numba_usable
from kvcanary.ops.check import check_forward
from kvcanary.ops.fingerprint import FingerprintMode, KVSource, fingerprint, source_meta
from kvcanary.ops.gather import gather_expected_tokens
from kvcanary.ops.landed import check_writes_landed, mark_writes
from kvcanary.ops.plan import Plan, build_plan
from kvcanary.ops.scatter import scatter_req_token_ids
from kvcanary.ops.stamp import stamp
from kvcanary.ops.state import DeviceFlag, DeviceState, Workspace
from kvcanary.ops.verify import verify

GUARD = 8
SLOW_CASE_S = 20.0  # a case this slow means some loop runs as long as a value says
EXTREMES = [-(2**63), -(2**62), -(2**31) - 1, -(2**31), -2, -1, 0, 1, 2, 2**31 - 1, 2**31, 2**62, 2**63 - 1]
TENSOR_MUTATIONS = ["extreme", "extreme", "extreme", "dtype", "grow", "shrink", "empty", "ndim", "strided", "stride0",
                    "meta", "nontensor"]


class Arena:
    """Tensors inside guard buffers; remembers which bytes belong to views."""

    def __init__(self, rng: random.Random, mutations: dict[str, str]):
        self.rng, self.mutations, self.names = rng, mutations, []
        self.bufs: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (name, flat buffer, view mask)

    def _flat(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        size = torch.empty(0, dtype=dtype).element_size()
        g = torch.Generator().manual_seed(self.rng.getrandbits(32))
        top = 2 if dtype == torch.bool else 256  # a bool byte other than 0 / 1 is not a value torch keeps
        return torch.randint(0, top, (n * size,), dtype=torch.uint8, generator=g).view(dtype)

    def t(self, name: str, values, dtype: torch.dtype = torch.int64):
        """A view holding ``values`` (mutated when ``name`` is a mutation target)."""
        self.names.append(name)
        v = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
        kind = self.mutations.get(name)
        layout = "contiguous"
        if kind == "extreme" and v.numel():
            flat = v.reshape(-1).clone()
            info = torch.iinfo(v.dtype) if not v.dtype.is_floating_point and v.dtype != torch.bool else None
            for _ in range(self.rng.randint(1, 3)):
                x = self.rng.choice(EXTREMES)
                if info is not None:
                    x = min(max(x, info.min), info.max)
                flat[self.rng.randrange(flat.numel())] = x
            v = flat.view(v.shape)
        elif kind == "dtype":
            dtypes = [d for d in (torch.int32, torch.int64, torch.uint8, torch.float32) if d != v.dtype]
            v = v.to(self.rng.choice(dtypes))
        elif kind == "grow":
            v = torch.cat([v, v[:1] if v.numel() else torch.zeros((1,) + tuple(v.shape[1:]), dtype=v.dtype)])
        elif kind == "shrink" and v.shape and v.shape[0]:
            v = v[:-1]
        elif kind == "empty" and v.dim():
            v = v[:0]
        elif kind == "ndim":
            v = v.unsqueeze(0)
        elif kind == "nontensor":
            return v.tolist()
        elif kind in ("strided", "stride0"):
            layout = kind
        view = self._place(name, v, layout)
        if kind == "meta":
            return torch.empty(view.shape, dtype=view.dtype, device="meta")
        return view

    def _place(self, name: str, v: torch.Tensor, layout: str) -> torch.Tensor:
        n = v.numel()
        step = 2 if layout == "strided" else 1
        span = 1 if layout == "stride0" else step * max(n, 1)
        flat = self._flat(span + 2 * GUARD, v.dtype)
        if layout == "stride0":
            strides = [0] * v.dim()
        else:
            strides = [step * math.prod(v.shape[i + 1:]) for i in range(v.dim())]
        view = flat.as_strided(v.shape, strides, GUARD)
        if layout == "stride0":
            if n:
                flat[GUARD] = v.reshape(-1)[0]
        else:
            view.copy_(v)
        mask = torch.zeros(flat.numel(), dtype=torch.bool)
        mask[torch.arange(flat.numel()).as_strided(v.shape, strides, GUARD).reshape(-1)] = True
        self.bufs.append((name, flat, mask))
        return view

    def snapshot(self) -> list[torch.Tensor]:
        return [f.clone() for _, f, _ in self.bufs]

    @staticmethod
    def same(x: torch.Tensor, y: torch.Tensor) -> bool:
        """Byte equality (float buffers may hold NaN patterns)."""
        return torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def rint(rng: random.Random, lo: int, hi: int) -> int:
    return rng.randint(lo, hi)


def maybe_int(rng: random.Random, mutations: dict, name: str, value):
    """An int argument, replaced by an adversarial one when ``name`` is a target."""
    if mutations.get(name) is None:
        return value
    return rng.choice([-1, -(2**63), 2**63 - 1, 10**12, True, 1.5, "1", None, (value or 0) + 1])


# --- a random forward: page table, prefix, writes, truth -------------------------------------------

@dataclasses.dataclass
class World:
    num_slots: int
    rows: int
    max_ctx: int
    rpi: list[int]
    prefix: list[int]
    extend: list[int]
    rtt: torch.Tensor
    ids: list[int]
    pos: list[int]
    loc: list[int]
    truth: torch.Tensor
    tlens: list[int]
    lut: list[int] | None
    window: int


def make_world(rng: random.Random) -> World:
    num_slots = rng.choice([2, 3, 17, 40, 70])
    bs = rng.choice([0, 1, 2, 3, 5])
    rows = bs + 1 + rng.randint(0, 2)
    max_ctx = rng.choice([1, 4, 9])
    free = list(range(1, num_slots))
    rng.shuffle(free)
    rpi = list(range(1, rows))
    rng.shuffle(rpi)
    rpi = [r if rng.random() > 0.15 else 0 for r in rpi[:bs]]
    prefix = [rng.randint(0, max_ctx) for _ in range(bs)]
    extend = [rng.randint(0, max_ctx - p) for p in prefix]
    g = torch.Generator().manual_seed(rng.getrandbits(32))
    rtt = torch.randint(-3, num_slots + 3, (rows, max_ctx), dtype=torch.int32, generator=g)
    wild = [-1, 0, num_slots, num_slots + 5]
    ids, pos, loc = [], [], []
    for r, p, e in zip(rpi, prefix, extend, strict=True):
        for c in range(p + e):
            slot = free.pop() if free and rng.random() > 0.1 else rng.choice(wild)
            if r:
                rtt[r, c] = slot
            if c >= p:  # a write: distinct valid slots (two writes into one slot race on any backend)
                ids.append(rng.choice([rng.randint(1, 50_000), rng.randint(-(2**63), 2**63 - 1)]))
                pos.append(c if rng.random() > 0.1 else c + rng.choice([-1, 1]))
                loc.append(slot if r else rng.choice([0, -1, num_slots + 2]))
    width = rng.choice([1, max_ctx, max_ctx + 2])
    truth = torch.randint(-5, 50_000, (rows, width), dtype=torch.int32, generator=g)
    tlens = [rng.randint(0, width + 1) for _ in range(bs)]
    lut, window = None, 0
    if rng.random() < 0.3:  # a sliding-window pool: translate every slot through a table
        lut = [rng.choice([0, rng.randint(1, num_slots - 1), -2, num_slots + 1]) for _ in range(num_slots + 2)]
        lut = [x if rng.random() > 0.1 else i for i, x in enumerate(lut)]
        window = rng.choice([0, 2, 5])
    return World(num_slots, rows, max_ctx, rpi, prefix, extend, rtt, ids, pos, loc, truth, tlens, lut, window)


def offsets(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def make_state(a: Arena, rng: random.Random, num_slots: int, with_ws: bool, max_bs: int, max_tokens: int):
    g = torch.Generator().manual_seed(rng.getrandbits(32))
    records = a.t("records", torch.randint(0, 256, (num_slots, 32), dtype=torch.uint8, generator=g), torch.uint8)
    cap = rng.choice([1, 3, 64])
    ring = a.t("ring", torch.full((cap, 8), -7), torch.int64)
    counter = a.t("ring_counter", [rng.choice([0, 0, 2, cap + 1])])
    stats = a.t("stats", torch.randint(0, 9, (NUM_LAUNCH_TAGS, NUM_STATS), generator=g))
    error = a.t("error", [0], torch.int32)
    workspaces = ()
    if with_ws:
        workspaces = tuple(Workspace(*(a.t(f"ws{k}.{f.name}", getattr(w, f.name)) for f in dataclasses.fields(w)))
                           for k, w in enumerate(Workspace.allocate(max(max_bs, 1), max(max_tokens, 1))
                                                 for _ in range(2)))
    return DeviceState(records, ring, counter, stats, error, workspaces)


def make_sources(a: Arena, rng: random.Random, num_slots: int):
    mode = rng.choice([FingerprintMode.NONE, FingerprintMode.PARTIAL, FingerprintMode.ALL])
    sources = []
    for i in range(rng.choice([0, 1, 2, 4])):
        page = rng.choice([1, 2])
        bpt = rng.choice([16, 32, 64])
        stride = page * bpt + rng.choice([0, 0, 16])
        pages = -(-num_slots // page) + rng.choice([0, 1])
        g = torch.Generator().manual_seed(rng.getrandbits(32))
        words = a.t(f"src{i}.words", torch.randint(-(2**31), 2**31 - 1, (pages * stride // 4,), dtype=torch.int32,
                                                   generator=g), torch.int32)
        sources.append(KVSource(words, num_slots + rng.choice([0, 0, 1]), bpt, page, stride if stride != page * bpt
                                else 0))
    return sources, mode


def make_plan(a: Arena, rng: random.Random, cap: int, max_bs: int, num_slots: int, filled: bool) -> Plan:
    proto = Plan.allocate(cap, max_bs)
    g = torch.Generator().manual_seed(rng.getrandbits(32))
    vals = {}
    for f in dataclasses.fields(proto):
        t = getattr(proto, f.name)
        if filled and f.name in ("slot", "pred"):
            v = torch.randint(-2, num_slots + 2, t.shape, generator=g)
        elif filled and f.name == "position":
            v = torch.randint(-1, 10, t.shape, generator=g)
        elif filled and f.name == "token":
            v = torch.randint(-1, 50_000, t.shape, generator=g)
        elif filled and f.name == "count":
            v = torch.tensor([rng.choice([0, cap, cap // 2, cap + 3, -1])])
        elif filled and f.name == "enable":
            v = torch.tensor([rng.choice([0, 1, 1, 7])])
        else:
            v = torch.randint(-50, 1000, t.shape, generator=g)
        vals[f.name] = a.t(f"plan.{f.name}", v, t.dtype)
    return Plan(**vals)


# --- one generator per op ----------------------------------------------------------------------------

def case_scatter(a, rng, m):
    w = make_world(rng)
    lengths = [rng.randint(0, 6) for _ in w.rpi]
    flat = [rng.randint(-(2**40), 2**40) for _ in range(sum(lengths))]
    return scatter_req_token_ids, dict(flat_in=a.t("flat_in", flat), offsets=a.t("offsets", offsets(lengths)),
                                       req_pool_indices=a.t("req_pool_indices", w.rpi),
                                       pool_out=a.t("pool_out", w.truth, torch.int32),
                                       error_flag=a.t("error_flag", [0], torch.int32))


def case_gather(a, rng, m):
    w = make_world(rng)
    return gather_expected_tokens, dict(
        truth=a.t("truth", w.truth, torch.int32), truth_lens=a.t("truth_lens", w.tlens),
        req_pool_indices=a.t("req_pool_indices", w.rpi), prefix_lens=a.t("prefix_lens", w.prefix),
        extend_offsets=a.t("extend_offsets", offsets(w.extend)), input_ids=a.t("input_ids", w.ids),
        out=a.t("out", [7] * len(w.ids)), shift=maybe_int(rng, m, "shift", rng.choice([0, 0, 1])))


def batch_kw(a, w, with_truth, rng):
    kw = dict(req_pool_indices=a.t("req_pool_indices", w.rpi), prefix_lens=a.t("prefix_lens", w.prefix),
              extend_lens=a.t("extend_lens", w.extend), req_to_token=a.t("req_to_token", w.rtt, torch.int32))
    if with_truth:
        kw.update(truth=a.t("truth", w.truth, torch.int32), truth_lens=a.t("truth_lens", w.tlens))
    if w.lut is not None:
        kw.update(lut=a.t("lut", w.lut), window=w.window)
    return kw


def case_plan(a, rng, m):
    w = make_world(rng)
    entries = sum(p for p, r in zip(w.prefix, w.rpi, strict=True) if r)
    kw = batch_kw(a, w, rng.random() < 0.6, rng)
    kw["plan"] = make_plan(a, rng, max(entries + rng.choice([-1, 0, 3]), 1), max(len(w.rpi), 1) + rng.choice([0, 1]),
                           w.num_slots, False)
    if "window" in kw:
        kw["window"] = maybe_int(rng, m, "window", kw["window"])
    return build_plan, kw


def case_verify(a, rng, m):
    num_slots = rng.choice([2, 5, 17, 40])
    state = make_state(a, rng, num_slots, False, 1, 1)
    sources, mode = make_sources(a, rng, num_slots)
    plan = make_plan(a, rng, rng.choice([1, 4, 33]), rng.choice([1, 3]), num_slots, True)
    meta = source_meta(sources, mode, "cpu") if sources and rng.random() < 0.5 else None
    if meta is not None:
        meta = a.t("meta", meta)
    return verify, dict(state=state, plan=plan, tag=maybe_int(rng, m, "tag", rng.randrange(NUM_LAUNCH_TAGS)),
                        sources=sources, mode=mode, meta=meta)


def case_stamp(a, rng, m):
    w = make_world(rng)
    state = make_state(a, rng, w.num_slots, False, 1, 1)
    seed = [rng.choice([-1, rng.randint(-2, w.num_slots + 2)]) for _ in w.rpi]
    kw = dict(state=state, out_cache_loc=a.t("out_cache_loc", w.loc), input_ids=a.t("input_ids", w.ids),
              positions=a.t("positions", w.pos), req_pool_indices=a.t("req_pool_indices", w.rpi),
              prefix_lens=a.t("prefix_lens", w.prefix), write_offsets=a.t("write_offsets", offsets(w.extend)),
              seed=a.t("seed", seed), tag=maybe_int(rng, m, "tag", rng.randrange(NUM_LAUNCH_TAGS)))
    if rng.random() < 0.5:
        kw["expected_tokens"] = a.t("expected_tokens", [x if rng.random() > 0.2 else x + 1 for x in w.ids])
    if w.lut is not None:
        kw["lut"] = a.t("lut", w.lut)
    return stamp, kw


def case_fingerprint(a, rng, m):
    num_slots = rng.choice([2, 5, 17])
    state = make_state(a, rng, num_slots, False, 1, 1)
    sources, mode = make_sources(a, rng, num_slots)
    n = rng.choice([0, 1, 5, 40])
    slots = [rng.randint(-2, num_slots + 2) for _ in range(n)]
    return fingerprint, dict(slots=a.t("slots", slots), sources=sources, mode=mode, state=state,
                             out=a.t("out", [3] * n), record=rng.random() < 0.5)


def case_check(a, rng, m):
    w = make_world(rng)
    stamp_ = rng.random() < 0.5
    state = make_state(a, rng, w.num_slots, rng.random() < 0.5, len(w.rpi) + rng.choice([0, 1]),
                       len(w.ids) + rng.choice([0, 1]))
    kw = batch_kw(a, w, rng.random() < 0.5, rng)
    kw.update(state=state, input_ids=a.t("input_ids", w.ids), positions=a.t("positions", w.pos),
              out_cache_loc=a.t("out_cache_loc", w.loc), tag=maybe_int(rng, m, "tag", rng.randrange(NUM_LAUNCH_TAGS)),
              stamp=stamp_, split=maybe_int(rng, m, "split", rng.choice([None, 1, 2])))
    kw["sources"], kw["mode"] = make_sources(a, rng, w.num_slots)  # HEAD marks the write targets, TAIL checks
    if "window" in kw:
        kw["window"] = maybe_int(rng, m, "window", kw["window"])
    return check_forward, kw


def _landed_kw(a, rng, m):
    w = make_world(rng)
    state = make_state(a, rng, w.num_slots, False, 1, 1)
    loc = w.loc + [rng.choice(w.loc)] if w.loc and rng.random() < 0.3 else w.loc  # a duplicate target
    kw = dict(state=state, out_cache_loc=a.t("out_cache_loc", loc),
              sources=make_sources(a, rng, w.num_slots)[0])
    if w.lut is not None:
        kw["lut"] = a.t("lut", w.lut)
    return w, loc, kw


def case_mark_writes(a, rng, m):
    return mark_writes, _landed_kw(a, rng, m)[2]


def case_landed(a, rng, m):
    w, loc, kw = _landed_kw(a, rng, m)
    for src in kw["sources"]:  # some targets hold their mark: HEAD marked them and the forward did not write
        if rng.random() < 0.7:
            mark_writes(state=kw["state"], out_cache_loc=kw["out_cache_loc"], sources=[src], lut=kw.get("lut"),
                        backend=Backend.TORCH)
    n = len(loc)
    kw.update(input_ids=a.t("input_ids", [rng.randint(-(2**63), 2**63 - 1) for _ in range(n)]),
              positions=a.t("positions", [rng.randint(0, 9) for _ in range(n)]),
              tag=maybe_int(rng, m, "tag", rng.randrange(NUM_LAUNCH_TAGS)))
    if rng.random() < 0.5:
        kw["out"] = a.t("out", [rng.random() < 0.5 for _ in range(n)], torch.bool)
    return check_writes_landed, kw


CASES: dict[str, Callable] = {"scatter": case_scatter, "gather": case_gather, "build_plan": case_plan,
                              "verify": case_verify, "stamp": case_stamp, "fingerprint": case_fingerprint,
                              "check_forward": case_check, "mark_writes": case_mark_writes,
                              "check_writes_landed": case_landed}
INT_ARGS = {"gather": ["shift"], "build_plan": ["window"], "verify": ["tag"], "stamp": ["tag"],
            "check_forward": ["tag", "split", "window"], "check_writes_landed": ["tag"]}


# --- running a case ------------------------------------------------------------------------------------

def build(op_name: str, seed: int, mutations: dict[str, str]):
    rng = random.Random(seed)
    a = Arena(rng, mutations)
    try:
        op, kw = CASES[op_name](a, rng, mutations)
    except Exception as e:  # noqa: BLE001 - a mutated buffer refused while building a state, plan or source
        return a, None, None, e
    return a, op, kw, None


def targets(op_name: str, seed: int) -> dict[str, str]:
    """The mutations of case ``seed``: none for a quarter of the cases, else one or two."""
    a, _, _, _ = build(op_name, seed, {})
    rng = random.Random(seed ^ 0x5EED)
    k = rng.choice([0, 1, 1, 2])
    names = list(dict.fromkeys(a.names)) + INT_ARGS.get(op_name, [])
    return {n: rng.choice(TENSOR_MUTATIONS) for n in rng.sample(names, min(k, len(names)))}


def run_one(op_name: str, seed: int, backend: Backend):
    m = targets(op_name, seed)
    a, op, kw, err = build(op_name, seed, m)
    before = a.snapshot()
    if err is None:
        try:
            op(**kw, backend=backend)
        except Exception as e:  # noqa: BLE001 - classified by the caller
            err = e
    return a, before, err


def _ring_rows(flat: torch.Tensor, mask: torch.Tensor, counter: int) -> tuple:
    rows = flat[mask].view(-1, 8)
    n = max(min(counter, rows.shape[0]), 0)
    return sorted(map(tuple, rows[:n].tolist())), rows[n:].tolist()


def m_names(a: Arena) -> set[str]:
    return set(a.mutations)


NUMBA_OPS = ("check_forward", "verify", "scatter")  # the ops with a compiled CPU kernel


def compare(op_name: str, seed: int) -> tuple[str, str | None]:
    """(outcome, problem): outcome is 'ok' or the error type's name; problem is None when the
    case holds every promise of the module doc."""
    outcome, problem = _compare(op_name, seed, Backend.TRITON)
    if problem is None and op_name in NUMBA_OPS and numba_usable():
        numba_outcome, problem = _compare(op_name, seed, Backend.NUMBA)
        if problem is None and numba_outcome != outcome and "workspace_flag" not in (outcome, numba_outcome):
            problem = f"numba: outcome {numba_outcome} != {outcome}"
    return outcome, problem


def _compare(op_name: str, seed: int, other: Backend) -> tuple[str, str | None]:
    """``compare`` of the torch path against ``other``."""
    runs = {b: run_one(op_name, seed, b) for b in (Backend.TORCH, other)}
    (a_t, _, err_t), (a_k, _, err_k) = runs[Backend.TORCH], runs[other]
    for label, (a, before, err) in (("torch", runs[Backend.TORCH]), (other.value, runs[other])):
        if err is not None:
            if not isinstance(err, InputError):
                return type(err).__name__, f"{label}: raw {type(err).__name__}: {err}"
            for (name, flat, _), b in zip(a.bufs, before, strict=True):
                if not Arena.same(flat, b):
                    return type(err).__name__, f"{label}: {name} changed before the error {err}"
        else:
            for (name, flat, mask), b in zip(a.bufs, before, strict=True):
                if not Arena.same(flat[~mask], b[~mask]):
                    return "ok", f"{label}: guard bytes of {name} written"
    flags = {n: int(f[mask][0]) for n, f, mask in a_k.bufs if n == "error" and err_k is None}
    if flags.get("error", 0) & DeviceFlag.WORKSPACE and any(n.startswith("ws") for n in m_names(a_k)):
        return "workspace_flag", None  # a stale workspace handed in: reported on the flag, nothing out of bounds
    if (err_t is None) != (err_k is None):
        return "mismatch", f"torch {err_t!r} vs {other.value} {err_k!r}"
    if err_t is not None:
        if type(err_t) is not type(err_k) or str(err_t) != str(err_k):
            return type(err_t).__name__, f"errors differ: torch {err_t!r} vs {other.value} {err_k!r}"
        return type(err_t).__name__, None
    counters = {n: int(f[mask][0]) for n, f, mask in a_t.bufs if n == "ring_counter"}
    for (name, ft, mask), (_, fk, _) in zip(a_t.bufs, a_k.bufs, strict=True):
        if name == "ring":
            cap = int(mask.sum()) // 8
            if counters["ring_counter"] <= cap and _ring_rows(ft, mask, counters["ring_counter"]) != \
                    _ring_rows(fk, mask, counters["ring_counter"]):
                return "ok", "ring rows differ between backends"
        elif not name.startswith("ws") and not Arena.same(ft, fk):  # workspaces: the kernel's scratch
            diff = (ft != fk).nonzero().flatten()
            return "ok", f"{name} differs between backends at {diff[:5].tolist()} (torch {ft[diff[:3]].tolist()} " \
                         f"{other.value} {fk[diff[:3]].tolist()})"
    return "ok", None


def fuzz(op_name: str, seeds, counts: Counter | None = None) -> list[str]:
    """Run the cases; returns the problems (empty when every case holds)."""
    counts = Counter() if counts is None else counts
    problems = []
    for seed in seeds:
        t0 = time.perf_counter()
        outcome, problem = compare(op_name, seed)
        if time.perf_counter() - t0 > SLOW_CASE_S:
            problem = problem or f"took {time.perf_counter() - t0:.1f} s (a loop bounded by a value, not a shape?)"
        counts[op_name, outcome] += 1
        if problem is not None:
            counts[op_name, "problem"] += 1
            problems.append(f"{op_name} seed {seed}: {problem}")
    return problems


if __name__ == "__main__":  # pragma: no cover - the published counts
    import argparse
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    p = argparse.ArgumentParser()
    p.add_argument("--cases", type=int, default=300, help="cases per op")
    p.add_argument("--first-seed", type=int, default=0)
    args = p.parse_args()
    counts, problems, t0 = Counter(), [], time.perf_counter()
    for name in CASES:
        problems += fuzz(name, range(args.first_seed, args.first_seed + args.cases), counts)
        print(f"{name} done at {time.perf_counter() - t0:.0f} s", flush=True)
    for name in CASES:
        row = {k[1]: v for k, v in counts.items() if k[0] == name}
        print(name, dict(sorted(row.items())))
    print(f"{sum(v for k, v in counts.items() if k[1] != 'problem')} cases, {len(problems)} problems, "
          f"{time.perf_counter() - t0:.0f} s")
    for line in problems[:40]:
        print(" ", line)
