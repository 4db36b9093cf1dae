"""The kept kernel's launch without ``CudaLauncher.__call__`` (``ops.launcher._direct``): the
launcher's C call receives exactly what that ``__call__`` of the installed Triton hands it, for
random arguments; a launcher with anything more to do (scratch buffers, the sanitizer), of another
class or of a release whose convention is not known, is left to ``kernel.run``. Runs on the CPU:
the C call is replaced by a recorder, so nothing launches."""

from __future__ import annotations

import random

import pytest
import torch

from kvcanary.ops import launcher

driver = pytest.importorskip("triton.backends.nvidia.driver")


class _Kernel:
    """A compiled kernel's parts that a launch reads."""

    def __init__(self, run):
        self.run, self.function, self.packed_metadata = run, random.getrandbits(48), (4, 1, random.randrange(1 << 16))


def _launcher(calls: list, **over) -> object:
    """The installed Triton's ``CudaLauncher``, built without compiling anything, its C call
    recording its arguments into ``calls``."""
    run = object.__new__(driver.CudaLauncher)
    fields = dict(launch=lambda *a: calls.append(a), num_ctas=1, global_scratch_size=0, global_scratch_align=1,
                  profile_scratch_size=0, profile_scratch_align=1, launch_cooperative_grid=random.random() < 0.5,
                  launch_pdl=random.random() < 0.5, arg_annotations=object(), kernel_signature=object(),
                  gsan_enabled=False)
    fields.update(over)
    for name, value in fields.items():
        setattr(run, name, value)
    return run


def _known() -> bool:
    import triton

    return tuple(int(x) for x in triton.__version__.split(".")[:2]) in launcher._CONVENTIONS


@pytest.mark.parametrize("seed", range(6))
def test_the_direct_call_hands_the_c_launch_what_tritons_call_hands_it(monkeypatch, seed):
    if not _known():
        pytest.skip("a Triton release whose launcher convention is not known: kernel.run serves")
    random.seed(seed)
    gen = torch.Generator().manual_seed(seed)
    via_run, direct = [], []
    kernel = _Kernel(_launcher(via_run))
    typed = launcher._Typed(kernel, None, [random.getrandbits(40)], (True, 128))
    assert typed.call is kernel.run.launch  # the launcher's own C call, kept
    typed.call = lambda *a: direct.append(a)  # ... replaced by a recorder of its own
    stream = random.getrandbits(40)
    monkeypatch.setattr(launcher, "_driver", lambda: (lambda: 0, lambda device: stream, _NoHooks()))
    from triton.runtime import driver as config  # what some releases' ``__call__`` reads first (no GPU here)

    monkeypatch.setattr(config, "_active", object())
    tensors = tuple(torch.randint(0, 100, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen)
                    for _ in range(3))
    ints = tuple(int(x) for x in torch.randint(-1000, 1000, (4,), generator=gen))
    grid = (random.randrange(1, 500), random.randrange(1, 4))
    k = launcher._kernel(_jit())
    k.typed.clear()
    key = (0, 4, "direct test", tuple(t.data_ptr() & 15 for t in tensors))
    k.typed[key] = typed
    launcher.launch_typed(_jit(), grid, tensors, ints, "direct test", {})
    addresses = [t.data_ptr() for t in tensors]
    kernel.run(grid[0], grid[1], 1, stream, kernel.function, kernel.packed_metadata, None, None, None,
               *typed.head, *addresses, *ints, *typed.tail)
    assert len(direct) == 1 and len(via_run) == 1
    assert direct[0] == via_run[0]


def test_a_launcher_with_more_to_do_is_left_to_its_call():
    if not _known():
        pytest.skip("a Triton release whose launcher convention is not known: kernel.run serves")
    assert launcher._direct(_Kernel(_launcher([])))[0] is not None
    for over in (dict(global_scratch_size=64), dict(profile_scratch_size=8), dict(gsan_enabled=True)):
        assert launcher._direct(_Kernel(_launcher([], **over))) == (None, (), False), over
    other = type("CudaLauncher", (), {"__call__": driver.CudaLauncher.__call__, "__module__": "elsewhere"})
    run = object.__new__(other)
    for name, value in vars(_launcher([])).items():
        setattr(run, name, value)
    assert launcher._direct(_Kernel(run)) == (None, (), False)


def test_a_release_whose_convention_is_not_known_is_left_to_its_call(monkeypatch):
    import inspect

    import triton

    monkeypatch.setattr(triton, "__version__", "9.1.0")
    assert launcher._direct(_Kernel(_launcher([]))) == (None, (), False)
    installed = tuple(inspect.signature(driver.CudaLauncher.__call__).parameters)
    for release, (_, parameters) in launcher._CONVENTIONS.items():  # a release named whose parameters differ
        if parameters != installed:
            monkeypatch.setattr(triton, "__version__", f"{release[0]}.{release[1]}.0")
            assert launcher._direct(_Kernel(_launcher([]))) == (None, (), False), release


class _NoHooks:
    launch_enter_hook = None
    launch_exit_hook = None


class _Param:
    def __init__(self, name: str, constexpr: bool):
        self.name, self.is_constexpr, self.do_not_specialize = name, constexpr, False


class _Fn:
    """A jitted function's parameters as ``launcher._Kernel`` reads them: seven arguments and two
    constexprs."""

    params = [_Param(f"a{i}", False) for i in range(7)] + [_Param("BLOCK", True), _Param("FLAG", True)]


_FN = _Fn()


def _jit():
    return _FN
