"""The direct Triton launch (``ops.launcher``): its key tells apart exactly the arguments Triton's
own specialisation tells apart, a kept kernel is launched without Triton's binding, and what it
computes is what Triton's launch computes; a bound launch (``BoundLaunch``) keys its bound
arguments once and again when one of them moves. On CUDA only (elsewhere Triton's own launch
serves), but for the key's parts and the values a bound launch hands a compiled kernel, checked
on any machine with a stand-in driver and kernel."""

from __future__ import annotations

import itertools

import pytest
import torch
import triton
import triton.language as tl

from kvcanary.ops import launcher
from kvcanary.ops.scatter import _scatter_kernel, offsets_from_lengths, scatter_req_token_ids

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _binder_specialisation(fn, args, constexprs) -> str:
    """Triton's own specialisation of ``args`` (what its kernel cache is keyed by)."""
    from triton.runtime import driver

    _, specialisation, options = fn.device_caches[driver.active.get_current_device()][4](*args, **constexprs,
                                                                                           num_warps=4)
    return str(specialisation) + str(options)


def _scatter_args(gen: torch.Generator, shift: int, big: bool):
    """Arguments of the scatter kernel: every tensor ``shift`` elements into its storage (for
    int64 an address a multiple of 16 at 0 and 2, for int32 at 0 only), its bound small or beyond
    int32 (which changes the argument's type)."""
    dev = torch.device("cuda")

    def view(n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(n + 4, dtype=dtype, device=dev)[shift: shift + n]

    bs, rows, width = 3, 4, 8
    ids, off, rpi = view(6, torch.int64), view(bs + 1, torch.int64), view(bs, torch.int64)
    ids.copy_(torch.randint(0, 100, (6,), generator=gen).to(dev))
    off.copy_(torch.tensor([0, 2, 4, 6], device=dev))
    rpi.copy_(torch.tensor([1, 2, 3], device=dev))
    pool = view(rows * width, torch.int32).view(rows, width)
    err, lens, starts = view(1, torch.int32), view(bs, torch.int64), view(bs, torch.int64)
    starts.copy_(torch.tensor([0, 1, 2], device=dev))
    n = 6 + (1 << 33 if big else 0)
    return (ids, off, rpi, pool, err, lens, starts, n, bs, rows, width, width)


@triton.jit(do_not_specialize=["b", "d"])
def _mixed(x_ptr, a, b, y_ptr, c, d, z_ptr, e, BLOCK: tl.constexpr):
    """Integers Triton specialises (a, c, e) and ones it does not (b, d), between pointers."""
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(y_ptr + i) + tl.load(z_ptr + i) + a + b + c + d + e)


def test_the_key_of_some_arguments_is_the_same_part_of_the_whole_key():
    """A bound launch keys its bound and its dynamic arguments apart, each at its position (which
    says whether Triton specialises an integer there): together they are the whole key."""
    from triton.runtime.jit import JITFunction

    gen = torch.Generator().manual_seed(5)
    # the parameters of the compiled kernel (under the interpreter, of the function it interprets)
    k = launcher._Kernel(_mixed if hasattr(_mixed, "params") else JITFunction(_mixed.fn, **_mixed.kwargs))
    assert {1, 4, 7} <= k.specialised and not {2, 5} & k.specialised

    def draw(i: int):
        if i in (0, 3, 6):
            dtype = (torch.int64, torch.int32)[int(torch.randint(0, 2, (1,), generator=gen))]
            return torch.zeros(int(torch.randint(1, 9, (1,), generator=gen)), dtype=dtype)
        return (1, 16, 32, 7, 1 << 33, 3)[int(torch.randint(0, 6, (1,), generator=gen))]

    for _ in range(40):
        args = tuple(draw(i) for i in range(k.num_args))
        dynamic = tuple(sorted(torch.randperm(len(args), generator=gen)[:4].tolist()))
        fixed = tuple(i for i in range(len(args)) if i not in dynamic)
        whole_key, whole_values = launcher._key(k, args)
        merged_key, merged_values = [None] * len(args), [None] * len(args)
        for at in (dynamic, fixed):
            key, values = launcher._key(k, tuple(args[i] for i in at), at)
            for i, part, value in zip(at, key, values, strict=True):
                merged_key[i], merged_values[i] = part, value
        assert tuple(merged_key) == whole_key and merged_values == whole_values


class _Compiled:
    """A compiled kernel as the fast path sees one: its launcher records what it is handed."""
    function, packed_metadata = "function", "metadata"

    def __init__(self, runs: list):
        self.runs = runs

    def run(self, *args):
        self.runs.append(args)


class _Jit:
    """A @triton.jit function as the launcher sees one, whose launch through Triton records its
    arguments and returns a ``_Compiled``: the fast path without a GPU."""

    def __init__(self, params):
        self.params, self.runs, self.first = params, [], []

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.first.append((grid, args, options))
            return _Compiled(self.runs)
        return launch


def test_a_bound_launch_hands_the_kernel_what_a_plain_launch_does(monkeypatch):
    """With a stand-in driver and kernel: for random arguments bound and dynamic at random
    positions, ``BoundLaunch`` goes through Triton once per key, as ``launch`` does, and then
    hands the compiled kernel's launcher the very values ``launch`` hands it, in order."""
    from triton.runtime.jit import JITFunction

    runtime = type("Runtime", (), {"launch_enter_hook": None, "launch_exit_hook": None})()
    monkeypatch.setattr(launcher, "_driver", lambda: (lambda: 0, lambda device: 77, runtime))
    params = (_mixed if hasattr(_mixed, "params") else JITFunction(_mixed.fn, **_mixed.kwargs)).params
    gen = torch.Generator().manual_seed(8)

    def draw(i: int):
        if i in (0, 3, 6):
            dtype = (torch.int64, torch.int32)[int(torch.randint(0, 2, (1,), generator=gen))]
            return torch.zeros(9, dtype=dtype)[int(torch.randint(0, 3, (1,), generator=gen)):]
        return (1, 16, 32, 7, 1 << 33, 3)[int(torch.randint(0, 6, (1,), generator=gen))]

    for _ in range(20):
        plain, bound_fn = _Jit(params), _Jit(params)
        dynamic = tuple(sorted(torch.randperm(8, generator=gen)[: int(torch.randint(1, 8, (1,), generator=gen))]
                               .tolist()))
        first = tuple(draw(i) for i in range(8))
        bound = launcher.BoundLaunch(bound_fn, tuple(None if i in dynamic else a for i, a in enumerate(first)),
                                     dynamic)
        for _ in range(4):
            args = tuple(draw(i) if i in dynamic else first[i] for i in range(8))
            for _ in range(2):  # the first launch of a key goes through Triton, the second is direct
                launcher.launch(plain, (3,), args, {"BLOCK": 16})
                bound((3,), tuple(args[i] for i in dynamic), {"BLOCK": 16})
        moved = [first[i] for i in (0, 3, 6) if i not in dynamic]
        if moved:  # a bound tensor moved to new storage at an odd offset: keyed again, its new address used
            moved[0].set_(torch.zeros(10, dtype=moved[0].dtype).untyped_storage(), 1, (8,), (1,))
            args = tuple(draw(i) if i in dynamic else first[i] for i in range(8))
            for _ in range(2):
                launcher.launch(plain, (3,), args, {"BLOCK": 16})
                bound((3,), tuple(args[i] for i in dynamic), {"BLOCK": 16})
        assert len(plain.first) == len(bound_fn.first) and plain.first == bound_fn.first
        assert len(plain.runs) == len(bound_fn.runs) >= 4 and plain.runs == bound_fn.runs


@gpu
@needs_cuda
def test_the_key_separates_what_triton_separates():
    gen = torch.Generator().manual_seed(3)
    k = launcher._Kernel(_scatter_kernel)
    cases = [_scatter_args(gen, off, big) for off, big in itertools.product((0, 1, 2), (False, True))]
    constexprs = dict(BLOCK=128, HAS_LENS=True, HAS_STARTS=True)
    for a, b in itertools.combinations(cases, 2):
        same_key = launcher._key(k, a)[0] == launcher._key(k, b)[0]
        same_spec = _binder_specialisation(_scatter_kernel, a, constexprs) == \
            _binder_specialisation(_scatter_kernel, b, constexprs)
        assert same_key == same_spec


@gpu
@needs_cuda
def test_a_kept_kernel_skips_tritons_launch_and_computes_the_same(monkeypatch):
    from triton.runtime.jit import JITFunction

    gen = torch.Generator().manual_seed(4)
    calls = []
    run = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **kw: calls.append(1) or run(self, *a, **kw))
    lengths = torch.randint(0, 9, (5,), generator=gen)
    offsets = offsets_from_lengths(lengths).cuda()
    flat = torch.randint(-1000, 1000, (int(lengths.sum()),), generator=gen).cuda()
    rows = torch.randperm(6, generator=gen)[:5].cuda()
    starts = torch.randint(0, 4, (5,), generator=gen).cuda()

    def scatter():
        pool = torch.full((6, 12), -5, dtype=torch.int32, device="cuda")
        lens = torch.zeros(5, dtype=torch.int64, device="cuda")
        calls.clear()
        scatter_req_token_ids(flat_in=flat, offsets=offsets, req_pool_indices=rows, pool_out=pool, lens_out=lens,
                              starts=starts)
        return pool.cpu(), lens.cpu(), len(calls)

    with monkeypatch.context() as m:
        m.setattr(launcher, "_driver", lambda: None)  # Triton's own launch, every time
        want_pool, want_lens, _ = scatter()
    scatter()  # keeps the kernel (or had kept it)
    pool, lens, launches = scatter()
    assert torch.equal(pool, want_pool) and torch.equal(lens, want_lens)
    assert launches == 0  # the kept kernel: no JITFunction.run


@gpu
@needs_cuda
def test_a_bound_launch_computes_what_tritons_launch_does_and_follows_a_moved_tensor(monkeypatch):
    """The scatter with its pool, flags and lengths bound and the batch dynamic: the same rows as
    Triton's own launch, no ``JITFunction.run`` once kept (by this BoundLaunch or another of the
    same kernel), and after the bound pool is moved to new storage (``set_``) the launch writes
    the new storage, not the freed one."""
    from triton.runtime.jit import JITFunction

    gen = torch.Generator().manual_seed(6)
    calls = []
    run = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **kw: calls.append(1) or run(self, *a, **kw))
    dev = torch.device("cuda")
    rows, width, bs = 7, 24, 4
    pool = torch.full((rows, width), -3, dtype=torch.int32, device=dev)
    err, lens = torch.zeros(1, dtype=torch.int32, device=dev), torch.zeros(bs, dtype=torch.int64, device=dev)
    args = (None, None, None, pool, err, lens, None, 0, bs, rows, width, width)
    bound = launcher.BoundLaunch(_scatter_kernel, args, (0, 1, 2, 6, 7))
    constexprs = dict(BLOCK=128, HAS_LENS=True, HAS_STARTS=True)

    def batch():
        lengths = torch.randint(1, 6, (bs,), generator=gen)
        flat = torch.randint(-1000, 1000, (int(lengths.sum()),), generator=gen).to(dev)
        offsets = offsets_from_lengths(lengths).to(dev)
        rpi = (torch.randperm(rows - 1, generator=gen)[:bs] + 1).to(dev)
        starts = torch.randint(0, 8, (bs,), generator=gen).to(dev)
        return flat, offsets, rpi, starts, flat.shape[0]

    def want(b, target):
        with monkeypatch.context() as m:
            m.setattr(launcher, "_driver", lambda: None)  # Triton's own launch
            out = torch.full_like(target, -3)
            launcher.launch(_scatter_kernel, (bs, 1), (b[0], b[1], b[2], out, err.clone(), lens.clone(), b[3], b[4],
                                                       bs, rows, width, width), constexprs)
            return out.cpu()

    def launched(launcher_, b) -> int:
        """JITFunction.run calls of one launch, after which the pool must hold Triton's rows."""
        pool.fill_(-3)
        calls.clear()
        launcher_((bs, 1), b, constexprs)
        n = len(calls)
        assert torch.equal(pool.cpu(), want(b, pool))
        return n

    assert [launched(bound, batch()) for _ in range(3)][1:] == [0, 0]  # kept since the first call
    again = launcher.BoundLaunch(_scatter_kernel, args, (0, 1, 2, 6, 7))  # check_forward's way: one a call
    assert launched(again, batch()) == 0  # the first one's kept kernel
    old = pool.data_ptr()
    # new storage, one int32 in: an address that is not a multiple of 16 (another specialisation)
    pool.set_(torch.full((rows * width + 1,), -3, dtype=torch.int32, device=dev).untyped_storage(),
              1, (rows, width), (width, 1))
    assert pool.data_ptr() != old and pool.data_ptr() % 16
    launched(bound, batch())


@gpu
@needs_cuda
def test_an_installed_launch_hook_takes_tritons_launch(monkeypatch):
    from triton import knobs
    from triton.runtime.jit import JITFunction

    seen, calls = [], []
    run = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **kw: calls.append(1) or run(self, *a, **kw))
    hook = knobs.runtime.launch_enter_hook
    if not hasattr(hook, "add"):
        pytest.skip("this Triton has no launch hook chain")
    record = seen.append
    hook.add(record)
    try:
        pool = torch.zeros(3, 4, dtype=torch.int32, device="cuda")
        for _ in range(2):
            scatter_req_token_ids(flat_in=torch.arange(3, device="cuda"), offsets=torch.tensor([0, 3], device="cuda"),
                                  req_pool_indices=torch.tensor([1], device="cuda"), pool_out=pool)
    finally:
        hook.remove(record)
    assert len(calls) == 2 and len(seen) == 2
