"""Every kernel variant the launchers use compiles for a real GPU target.

The interpreter runs a kernel's Python on numpy, not Triton's compiler: a kernel can pass every
interpreted test and still fail to compile (a constant that does not fit its type, a value whose
type changes across a loop). Compiling needs no GPU (the code generator and ptxas run on the
host). A subprocess without TRITON_INTERPRET calls the public ops on CPU tensors with
``backend=Backend.TRITON``; each launch is intercepted and compiled for sm_90 instead of run, so
exactly the launched signatures, constexprs and options are compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvcanary.ops._common import HAS_TRITON

SCRIPT = r"""
import sys

import torch
import triton
from triton.backends import backends
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

if "nvidia" not in backends:
    print("SKIP: triton has no nvidia backend here")
    sys.exit(0)

DTYPES = {torch.int64: "i64", torch.int32: "i32", torch.uint8: "u8"}
compiled = set()


def compile_instead_of_run(self, *args, grid, warmup, **kwargs):
    names = [p.name for p in self.params]
    options = {k: kwargs.pop(k) for k in list(kwargs) if k not in names}
    bound = {**dict(zip(names, args)), **kwargs}
    signature, constexprs = {}, {}
    for p in self.params:
        v = bound[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            signature[p.name] = "*" + DTYPES[v.dtype]
        else:
            signature[p.name] = "i32" if -(2**31) <= int(v) < 2**31 else "i64"
    key = (self.__name__, tuple(sorted(signature.items())), tuple(sorted(constexprs.items())),
           tuple(sorted(options.items())))
    if key not in compiled:
        triton.compile(ASTSource(fn=self, signature=signature, constexprs=constexprs),
                       target=GPUTarget("cuda", 90, 32), options=options)
        compiled.add(key)
        print("ok", self.__name__, constexprs, options)


JITFunction.run = compile_instead_of_run

from kvcanary.ops._common import Backend
from kvcanary.ops.check import check_forward
from kvcanary.ops.fingerprint import FingerprintMode, KVSource, fingerprint
from kvcanary.ops.gather import gather_expected_tokens
from kvcanary.ops.plan import Plan, build_plan
from kvcanary.ops.scatter import scatter_req_token_ids
from kvcanary.ops.stamp import stamp
from kvcanary.ops.state import DeviceState
from kvcanary.ops.verify import verify

T = Backend.TRITON
i64 = lambda *v: torch.tensor(v, dtype=torch.int64)
rpi, prefix, extend = i64(1, 2), i64(2, 3), i64(1, 2)
rtt = torch.ones(3, 8, dtype=torch.int32)
truth = torch.ones(3, 8, dtype=torch.int32)
state = DeviceState.allocate(16, ring_capacity=8, max_bs=2, max_tokens=8)

scatter_req_token_ids(flat_in=i64(1, 2, 3), offsets=i64(0, 1, 3), req_pool_indices=rpi, pool_out=truth, backend=T)
gather_expected_tokens(truth=truth, truth_lens=i64(4, 4), req_pool_indices=rpi, prefix_lens=prefix,
                       extend_offsets=i64(0, 1, 3), input_ids=i64(5, 6, 7), backend=T)
for with_truth in (False, True):
    for lut in (None, torch.arange(16)):
        extra = dict(truth=truth, truth_lens=i64(4, 4)) if with_truth else {}
        plan = build_plan(req_pool_indices=rpi, prefix_lens=prefix, extend_lens=extend, req_to_token=rtt,
                          plan=Plan.allocate(8, 2), lut=lut, window=2 if lut is not None else 0, backend=T, **extra)
for n in (3, 1500):  # one block, and several (the carry across blocks)
    for expected, lut in ((None, None), (torch.zeros(n, dtype=torch.int64), torch.arange(16))):
        stamp(state=state, out_cache_loc=torch.ones(n, dtype=torch.int64), input_ids=torch.ones(n, dtype=torch.int64),
              positions=torch.ones(n, dtype=torch.int64), req_pool_indices=rpi, prefix_lens=prefix,
              write_offsets=i64(0, 1, n), seed=i64(-1, 3), tag=1,
              expected_tokens=expected, lut=lut, backend=T)
kv = [KVSource.from_buffer(torch.zeros(8, 2, bpt, dtype=torch.uint8), page_size=2) for bpt in (16, 64, 256, 512)]
for sources in (kv[:1], kv[:2], kv[2:], kv):
    for mode in (FingerprintMode.PARTIAL, FingerprintMode.ALL):
        fingerprint(slots=i64(1, 2, 3), sources=sources, mode=mode, state=state, record=True, backend=T)
        verify(state=state, plan=Plan.allocate(8, 2), tag=4, sources=sources, mode=mode, backend=T)
verify(state=state, plan=Plan.allocate(8, 2), tag=0, backend=T)
batch = dict(state=state, req_pool_indices=rpi, prefix_lens=prefix, extend_lens=extend, req_to_token=rtt,
             input_ids=i64(1, 2, 3), positions=i64(2, 3, 4), out_cache_loc=i64(5, 6, 7), backend=T)
with_truth = dict(truth=truth, truth_lens=i64(4, 4))
for lut in (None, torch.arange(16)):  # a LUT with fingerprints once broke a layout pass (sm_90 only)
    window = dict(lut=lut, window=2 if lut is not None else 0)
    check_forward(**batch, tag=0, stamp=True, **window, **with_truth)
    check_forward(**batch, tag=0, stamp=True, **window)
    check_forward(**batch, tag=4, stamp=False, sources=kv[:2], mode=FingerprintMode.PARTIAL, **window, **with_truth)
    check_forward(**batch, tag=4, stamp=False, sources=kv, mode=FingerprintMode.ALL, **window)
    check_forward(**batch, tag=4, stamp=False, sources=kv[:1], mode=FingerprintMode.ALL, **window)
check_forward(**batch, tag=4, stamp=False)
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    assert proc.stdout.count("ok ") >= 10, proc.stdout
