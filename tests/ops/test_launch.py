"""The direct Triton launch (``ops.launcher``): its key tells apart exactly the arguments Triton's
own specialisation tells apart, a kept kernel is launched without Triton's binding, and what it
computes is what Triton's launch computes. On CUDA only: elsewhere Triton's own launch serves."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvcanary.ops import launcher
from kvcanary.ops.scatter import _scatter_kernel, offsets_from_lengths, scatter_req_token_ids

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


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


def test_fixed_leading_arguments_key_and_launch_as_the_whole_list():
    gen = torch.Generator().manual_seed(6)
    k = launcher._Kernel(_scatter_kernel)
    for shift, big in itertools.product((0, 1, 2), (False, True)):
        a = _scatter_args(gen, shift, big)
        whole_key, whole_values = launcher._key(k, a)
        for cut in (0, 1, 4, 7, len(a)):
            fixed = launcher.Fixed(_scatter_kernel, a[:cut])
            key, values = launcher._key(k, a[cut:], cut)
            assert fixed.key + key == whole_key and fixed.values + values == whole_values

    lengths = torch.randint(1, 9, (4,), generator=gen)
    offsets = offsets_from_lengths(lengths).cuda()
    flat = torch.randint(-1000, 1000, (int(lengths.sum()),), generator=gen).cuda()
    rows = torch.randperm(6, generator=gen)[:4].cuda()
    starts = torch.randint(0, 3, (4,), generator=gen).cuda()
    constexprs = dict(BLOCK=128, HAS_LENS=True, HAS_STARTS=True)  # grid: the check's program, then 4 requests

    def scatter(cut: int | None):
        pool = torch.full((6, 12), -5, dtype=torch.int32, device="cuda")
        err, lens = torch.zeros(1, dtype=torch.int32, device="cuda"), torch.zeros(4, dtype=torch.int64, device="cuda")
        args = (flat, offsets, rows, pool, err, lens, starts, flat.shape[0], 4, 6, 12, 12)
        if cut is None:
            launcher.launch(_scatter_kernel, (5, 1), args, constexprs)
        else:
            launcher.launch(_scatter_kernel, (5, 1), args[cut:], constexprs,
                            fixed=launcher.Fixed(_scatter_kernel, args[:cut]))
        return pool.cpu(), lens.cpu(), err.cpu()

    want = scatter(None)
    assert (want[0] != -5).any()
    for cut in (0, 3, 7, 12):
        for _ in range(2):  # the first launch of a key through Triton, then the kept kernel
            got = scatter(cut)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def _two_requests(seed: int) -> tuple:
    """(flat, offsets, rows, pool, err): 8 random tokens for rows 1 and 2 (3 and 5 of them) of a
    3 x 8 pool filled with -5, and a zeroed error flag."""
    flat = torch.randint(-1000, 1000, (8,), generator=torch.Generator().manual_seed(seed)).cuda()
    offsets, rows = torch.tensor([0, 3, 8], device="cuda"), torch.tensor([1, 2], device="cuda")
    return (flat, offsets, rows, torch.full((3, 8), -5, dtype=torch.int32, device="cuda"),
            torch.zeros(1, dtype=torch.int32, device="cuda"))


def _grow_in_place(pool: torch.Tensor) -> None:
    """Resize ``pool`` to 2**20 rows in place (a new allocation: the old address is freed), -5 again."""
    before = pool.data_ptr()
    pool.resize_(1 << 20, 8).fill_(-5)
    assert pool.data_ptr() != before


def _assert_two_requests_landed(flat: torch.Tensor, pool: torch.Tensor, err: torch.Tensor) -> None:
    torch.cuda.synchronize()
    assert pool[1, :3].tolist() == flat[:3].tolist() and pool[2, :5].tolist() == flat[3:].tolist()
    assert int(err[0]) == 0 and int((pool != -5).sum()) == 8


def test_a_fixed_tensor_resized_in_place_is_launched_at_its_new_address():
    flat, offsets, rows, pool, err = _two_requests(7)
    fixed = launcher.Fixed(_scatter_kernel, (flat, offsets, rows, pool, err, err, offsets))
    constexprs = dict(BLOCK=128, HAS_LENS=False, HAS_STARTS=False)  # grid: the check's program, 2 requests
    launcher.launch(_scatter_kernel, (3, 1), (8, 2, 3, 8, 8), constexprs, fixed=fixed)
    launcher.launch(_scatter_kernel, (3, 1), (8, 2, 3, 8, 8), constexprs, fixed=fixed)  # the kept kernel
    _grow_in_place(pool)
    launcher.launch(_scatter_kernel, (3, 1), (8, 2, 1 << 20, 8, 8), constexprs, fixed=fixed)
    _assert_two_requests_landed(flat, pool, err)


def _typed_scatter(shift: int, big: bool, seed: int):
    """The scatter through ``launch_typed`` (its variant: the constexprs; the dtypes are the
    kernel's own) on ``_scatter_args``, and the same launch through Triton's; both results."""
    constexprs = dict(BLOCK=128, HAS_LENS=True, HAS_STARTS=True)
    results = []
    for typed in (False, True):
        args = _scatter_args(torch.Generator().manual_seed(seed), shift, big)
        tensors, ints = args[:7], args[7:]
        if typed:
            launcher.launch_typed(_scatter_kernel, (4, 1), tensors, ints, "typed test", constexprs)
        else:
            _scatter_kernel[(4, 1)](*args, **constexprs)
        results.append([t.cpu() for t in (tensors[3], tensors[4], tensors[5])])
    return results


def test_a_typed_launch_relaunches_its_variants_kernel_and_computes_as_tritons_launch(monkeypatch):
    from triton.runtime.jit import JITFunction

    k = launcher._kernel(_scatter_kernel)
    k.typed.clear()
    runs, keyed = [], []
    run, keyed_launch = JITFunction.run, launcher.launch
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **kw: runs.append(1) or run(self, *a, **kw))
    monkeypatch.setattr(launcher, "launch", lambda *a, **kw: keyed.append(1) or keyed_launch(*a, **kw))
    for seed in (1, 2):  # the first call keys the arguments and keeps the kernel for the variant
        want, got = _typed_scatter(0, False, seed)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert len(k.typed) == 1
    for shift in (0, 1, 2):  # addresses at other residues modulo 16: keyed once each, then kept
        for seed in (3, 4):
            runs.clear(), keyed.clear()
            want, got = _typed_scatter(shift, False, seed)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
            assert len(keyed) or len(runs) == 1  # kept: the one JITFunction.run is the reference launch
            assert len(keyed) == (seed == 3 and shift != 0)
    assert len(k.typed) == 3
    import triton

    if tuple(int(x) for x in triton.__version__.split(".")[:2]) in launcher._CONVENTIONS:
        # the kept kernels launched through their launcher's C call (``_direct``), not ``kernel.run``
        assert all(t.call is t.kernel.run.launch for t in k.typed.values())
    for shift in (0, 1):  # an int beyond int32: keyed every time, nothing kept for it
        keyed.clear()
        want, got = _typed_scatter(shift, True, 5)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        assert len(keyed) == 1
    assert len(k.typed) == 3


def test_a_typed_launch_with_a_moved_fixed_tensor_keys_it_again():
    flat, offsets, rows, pool, err = _two_requests(8)
    fixed = launcher.Fixed(_scatter_kernel, (flat, offsets, rows, pool))
    constexprs = dict(BLOCK=128, HAS_LENS=False, HAS_STARTS=False)
    for _ in range(2):
        launcher.launch_typed(_scatter_kernel, (3, 1), (err, err, offsets), (8, 2, 3, 8, 8), "v", constexprs,
                              fixed=fixed)
    (kept,) = fixed.typed.values()  # one (device, warps, variant, address residues)
    _grow_in_place(pool)
    launcher.launch_typed(_scatter_kernel, (3, 1), (err, err, offsets), (8, 2, 1 << 20, 8, 8), "v", constexprs,
                          fixed=fixed)
    _assert_two_requests_landed(flat, pool, err)
    assert len(fixed.typed) == 1 and next(iter(fixed.typed.values())) is not kept  # kept again, new address
