"""``signal_row``: its Triton kernel (TRITON_INTERPRET=1 on CPU), its torch path and the short
pure-Python reference below agree byte for byte on fresh random rings, counters, marks, records
and batches; the Triton launches compile for sm_90; bad inputs are refused naming the argument."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch
from tests.ops._compare import assert_same
from tests.ops._helpers import BACKEND_IDS, BACKENDS, device_for
from tests.ops.test_compile import SCRIPT as COMPILE_OPS

from kvcanary.core.hashing import MASK64, splitmix64, to_signed, to_unsigned
from kvcanary.distributed import SignalBuffers, signal_row
from kvcanary.errors import InputError, InputTypeError
from kvcanary.ops import Backend, DeviceState
from kvcanary.ops.signal import ALARM_BIT, POINT_SHIFT, POSITION_SALT, REASON_MASK, ROW_SALT, TOKEN_SALT

# --- the reference ---------------------------------------------------------------------------------


def ref_ring(ring: list[list[int]], lo: int, hi: int) -> tuple[int, int]:
    rows, code = max(hi - lo, 0), 0
    for i in range(max(lo, 0), min(hi, len(ring))):
        tag, reasons = ring[i][0], ring[i][7]
        code |= (reasons & REASON_MASK) | 1 << (POINT_SHIFT + (max(tag, 0) // 4) % 4)
    return rows, code


def ref_digest(words: list[list[int]], rpi: list[int], ext: list[int], ocl: list[int]) -> int:
    total, end = 0, 0
    for i, (row, n) in enumerate(zip(rpi, ext, strict=True)):
        end += n
        t = min(max(end - 1, 0), max(len(ocl) - 1, 0))
        slot = min(max(ocl[t] if ocl else 0, 0), len(words) - 1)
        tok, pos, chain = (to_unsigned(w) for w in words[slot][:3])
        key = ((to_unsigned(row) * ROW_SALT) & MASK64) ^ i
        if row != 0:
            total += splitmix64((chain + tok * TOKEN_SALT + pos * POSITION_SALT + key) & MASK64)
    return to_signed(total & MASK64)


def ref_signal(rings, counters, marks, pending, alarm, step, world, rank, words, batch):
    """One call on plain lists: returns (marks, pending, alarm, step, table or None)."""
    rows, code = 0, 0
    for ring, hi, lo in zip(rings, counters, marks, strict=True):
        r, c = ref_ring(ring, lo, hi)
        rows, code = rows + r, code | c
    marks = list(counters)
    if world is None:
        return marks, [pending[0] + rows, pending[1] | code], alarm, step, None
    table = [[0] * 4 for _ in range(world)]
    digest = ref_digest(words, *batch) if batch is not None else 0
    table[rank] = [rows + pending[0], code | pending[1] | (ALARM_BIT if alarm else 0), digest, step]
    return marks, [0, 0], 0, step + 1, table


# --- random inputs -----------------------------------------------------------------------------------


def random_state(rng: random.Random, num_slots: int, capacity: int) -> DeviceState:
    state = DeviceState.allocate(num_slots, ring_capacity=capacity)
    g = torch.Generator().manual_seed(rng.randrange(2**32))
    state.records.copy_(torch.randint(0, 256, state.records.shape, dtype=torch.uint8, generator=g))
    state.ring.copy_(torch.randint(-2**62, 2**62, state.ring.shape, generator=g))
    tags = torch.randint(-1, 14, (capacity,), generator=g)  # -1: an unwritten row; > 11: out of range
    state.ring[:, 0] = tags
    state.ring_counter.fill_(rng.choice([rng.randrange(0, 2 * capacity + 2), -rng.randrange(1, 9)]))  # < 0: hostile
    return state


def random_batch(rng: random.Random, num_slots: int):
    bs = rng.choice([0, 1, 3, 17, 300])  # 300: more than one chunk of the kernel's lanes
    ext = [rng.choice([0, 1, 1, 2, 5]) for _ in range(bs)]
    ocl = [rng.randrange(-3, num_slots + 3) for _ in range(sum(ext) + rng.choice([0, 0, 2]))]
    rpi = [rng.choice([0, rng.randrange(1, 2**40), -rng.randrange(1, 9)]) for _ in range(bs)]
    return rpi, ext, ocl


def t64(x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int64)


def run_case(seed: int, backend: Backend):
    """A sequence of settle and emit calls over 1-2 rings; returns every output of every call,
    with the reference's, as (name, actual, expected) triples."""
    rng = random.Random(seed)
    device = device_for(backend)
    num_rings = rng.choice([1, 2])
    states = [random_state(rng, rng.choice([2, 9, 64]), rng.choice([1, 5, 300])) for _ in range(num_rings)]
    buffers = SignalBuffers.allocate(num_rings)
    buffers.marks.copy_(t64([rng.choice([rng.randrange(0, 700), -rng.randrange(1, 9)]) for _ in range(num_rings)]))
    buffers.pending.copy_(t64([rng.randrange(0, 50), rng.randrange(0, 2**41)]))
    buffers.alarm.fill_(rng.choice([0, 1, 7]))
    buffers.step.fill_(rng.randrange(-2, 1000))
    ref = dict(marks=buffers.marks.tolist(), pending=buffers.pending.tolist(), alarm=int(buffers.alarm),
               step=int(buffers.step))
    rings = [s.ring.tolist() for s in states]
    words = states[0].records.view(torch.int64).tolist()
    dev_states = [DeviceState(*(t.to(device) for t in (s.records, s.ring, s.ring_counter, s.stats))) for s in states]
    dev_buffers = SignalBuffers(*(t.to(device) for t in (buffers.marks, buffers.pending, buffers.alarm, buffers.step)))
    out = []
    for call in range(4):
        for d in dev_states:  # new rows, or a reporter reset
            d.ring_counter.fill_(rng.choice([int(d.ring_counter), int(d.ring_counter) + rng.randrange(1, 40), 0]))
        counters = [int(d.ring_counter) for d in dev_states]
        emit = call % 2 == 1 or rng.random() < 0.3
        world = rng.choice([1, 2, 3, 5]) if emit else None
        rank = rng.randrange(world) if emit else 0
        batch = random_batch(rng, dev_states[0].num_slots) if emit and rng.random() < 0.8 else None
        table = torch.full((world, 4), 99, dtype=torch.int64, device=device) if emit else None
        tensors = dict(zip(("req_pool_indices", "extend_lens", "out_cache_loc"),
                           (t64(x).to(device) for x in batch), strict=True)) if batch else {}
        signal_row(states=dev_states, buffers=dev_buffers, table=table, rank=rank, backend=backend, **tensors)
        ref["marks"], ref["pending"], ref["alarm"], ref["step"], want = ref_signal(
            rings, counters, ref["marks"], ref["pending"], ref["alarm"], ref["step"], world, rank, words, batch)
        if emit:
            out.append((f"call {call} table", table.clone(), want))
        for name in ("marks", "pending"):
            out.append((f"call {call} {name}", getattr(dev_buffers, name).clone(), ref[name]))
        out.append((f"call {call} alarm", dev_buffers.alarm.clone(), [ref["alarm"]]))
        out.append((f"call {call} step", dev_buffers.step.clone(), [ref["step"]]))
    return out


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_signal_row_equals_the_reference_on_random_inputs(backend):
    seeds = random.Random().sample(range(2**32), 6)  # fresh inputs every run; the seed is in the message
    for seed in seeds:
        for name, actual, expected in run_case(seed, backend):
            try:
                assert_same(name, actual, expected)
            except AssertionError as e:
                raise AssertionError(f"seed {seed}: {e}") from None


def test_torch_path_on_device_tensors_equals_the_reference(monkeypatch):
    """The torch path's branch for device tensors (no host reads: the ring masked with the device
    bounds), run here on CPU tensors treated as device ones."""
    import kvcanary.ops.signal as op

    monkeypatch.setattr(op, "is_host", lambda t: False)
    for seed in random.Random().sample(range(2**32), 4):
        for name, actual, expected in run_case(seed, Backend.TORCH):
            try:
                assert_same(name, actual, expected)
            except AssertionError as e:
                raise AssertionError(f"seed {seed}: {e}") from None


def test_torch_path_and_kernel_agree_byte_for_byte():
    seed = random.randrange(2**32)
    a, b = run_case(seed, Backend.TORCH), run_case(seed, Backend.TRITON)
    assert [n for n, _, _ in a] == [n for n, _, _ in b]
    for (name, x, _), (_, y, _) in zip(a, b, strict=True):
        assert_same(f"seed {seed}: {name}", x.cpu(), y.cpu())


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_digest_of_a_known_batch_and_the_alarm_bit(backend):
    """Hand-checked: one ring with a HEAD chain row and a TAIL fingerprint row past the mark."""
    device = device_for(backend)
    state = DeviceState.allocate(8, ring_capacity=4, device=device)
    words = state.records.view(torch.int64)
    words[3, :3] = t64([17, 4, 12345])
    state.ring[1, 0], state.ring[1, 7] = 0, 1  # HEAD.FULL.K chain
    state.ring[2, 0], state.ring[2, 7] = 5, 4  # TAIL.FULL.V fingerprint
    state.ring_counter.fill_(3)
    buffers = SignalBuffers.allocate(1, device)
    buffers.marks.fill_(1)
    buffers.alarm.fill_(1)
    buffers.step.fill_(41)
    table = torch.full((2, 4), 5, dtype=torch.int64, device=device)
    signal_row(states=[state], buffers=buffers, table=table, rank=1, req_pool_indices=t64([2, 0]).to(device),
               extend_lens=t64([2, 1]).to(device), out_cache_loc=t64([6, 3, 0]).to(device), backend=backend)
    code = 1 | 4 | 1 << POINT_SHIFT | 1 << (POINT_SHIFT + 1) | ALARM_BIT
    digest = to_signed(splitmix64((12345 + 17 * TOKEN_SALT + 4 * POSITION_SALT + ((2 * ROW_SALT) & MASK64))
                                  & MASK64))
    assert table.tolist() == [[0, 0, 0, 0], [2, code, digest, 41]]
    assert buffers.marks.tolist() == [3] and int(buffers.step) == 42 and int(buffers.alarm) == 0


def good_args():
    state = DeviceState.allocate(8, ring_capacity=4)
    return dict(states=[state], buffers=SignalBuffers.allocate(1), table=torch.zeros(2, 4, dtype=torch.int64),
                rank=0, req_pool_indices=t64([1]), extend_lens=t64([1]), out_cache_loc=t64([3]))


@pytest.mark.parametrize("change, error, message", [
    (dict(states=[]), InputTypeError, "states must be a non-empty sequence of DeviceState"),
    (dict(states=["x"]), InputTypeError, r"states\[0\] must be a DeviceState, got str"),
    (dict(buffers=SignalBuffers.allocate(2)), InputError, r"buffers.marks length 2 != len\(states\) \(1\)"),
    (dict(table=torch.zeros(2, 3, dtype=torch.int64)), InputError, r"table shape \(2, 3\) != \(world, 4\)"),
    (dict(table=torch.zeros(2, 4, dtype=torch.int32)), InputTypeError, "table dtype int32 != int64"),
    (dict(rank=2), InputError, r"rank 2 out of range \[0, 2\)"),
    (dict(extend_lens=None), InputError, "extend_lens is None but the other batch tensors were passed"),
    (dict(extend_lens=t64([1, 1])), InputError, r"extend_lens length 2 != len\(req_pool_indices\) \(1\)"),
    (dict(extend_lens=t64([-1])), InputError, r"extend_lens\[0\] = -1 < 0"),
    (dict(out_cache_loc=torch.tensor([3], dtype=torch.int32)), InputTypeError, "out_cache_loc dtype int32 != int64"),
    (dict(table=None), InputError, "a batch was passed without table"),
])
def test_bad_inputs_are_refused_before_any_write(change, error, message):
    args = {**good_args(), **change}
    before = [t.clone() for t in (args["buffers"].marks, args["buffers"].step)]
    with pytest.raises(error, match=message):
        signal_row(**args)
    assert [t.tolist() for t in (args["buffers"].marks, args["buffers"].step)] == [t.tolist() for t in before]


def test_signal_buffers_refuse_bad_buffers():
    with pytest.raises(InputError, match="num_rings 0 must be an int >= 1"):
        SignalBuffers.allocate(0)
    z = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(InputError, match=r"SignalBuffers.pending length 1 != 2"):
        SignalBuffers(z, z.clone(), z.clone(), z.clone())


SHIM = "JITFunction.run = compile_instead_of_run\n"  # the ops' compile test intercepts launches up to here
COMPILE = COMPILE_OPS[:COMPILE_OPS.index(SHIM) + len(SHIM)] + r"""
from kvcanary.distributed import SignalBuffers, signal_row
from kvcanary.ops import Backend, DeviceState

i64 = lambda *v: torch.tensor(v, dtype=torch.int64)
states = [DeviceState.allocate(16, ring_capacity=8), DeviceState.allocate(16, ring_capacity=8)]
buffers = SignalBuffers.allocate(2)
table = torch.zeros(2, 4, dtype=torch.int64)
signal_row(states=states, buffers=buffers, backend=Backend.TRITON)
signal_row(states=states, buffers=buffers, table=table, rank=1, backend=Backend.TRITON)
signal_row(states=states, buffers=buffers, table=table, rank=1, req_pool_indices=i64(1, 2), extend_lens=i64(1, 2),
           out_cache_loc=i64(3, 4, 5), backend=Backend.TRITON)
"""


def test_signal_kernel_compiles_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    variants = [(False, False), (True, False), (True, True)]  # settle, emit without and with a batch
    for emit, has_batch in variants:
        assert f"'EMIT': {emit}, 'HAS_BATCH': {has_batch}" in proc.stdout, proc.stdout
    assert proc.stdout.count("ok ") == len(variants), proc.stdout


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_the_launch_point_is_read_below_a_source_mask(backend):
    """A fingerprint row's tag column carries the differing sources above its low 8 bits: the
    signal still names TAIL, and the reason bits stay the row's."""
    from kvcanary.core.record import COL_REASONS, COL_TAG, SOURCE_MASK_SHIFT, LaunchPoint, LaunchTag, Reason
    from kvcanary.ops.signal import CODE

    device = device_for(backend)
    state = DeviceState.allocate(16, ring_capacity=4, device=device)
    state.ring[0, COL_TAG] = LaunchTag(LaunchPoint.TAIL).value | 0b1010 << SOURCE_MASK_SHIFT
    state.ring[0, COL_REASONS] = int(Reason.FINGERPRINT)
    state.ring_counter.fill_(1)
    table = torch.zeros(1, 4, dtype=torch.int64, device=device)
    signal_row(states=[state], buffers=SignalBuffers.allocate(1, device=device), table=table, rank=0, backend=backend)
    assert int(table[0, CODE]) == int(Reason.FINGERPRINT) | 1 << (POINT_SHIFT + LaunchPoint.TAIL)
