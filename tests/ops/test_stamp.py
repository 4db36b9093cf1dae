from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcanary.core.hashing import chain_values, to_signed
from kvcanary.core.record import (
    CHAIN,
    POSITION,
    STAT_STAMPED,
    LaunchPoint,
    LaunchTag,
    new_ring,
    new_stats,
    record_words,
)
from kvcanary.errors import InputError
from kvcanary.ops._common import Backend
from kvcanary.ops.scatter import offsets_from_lengths
from kvcanary.ops.stamp import _stamp_block, stamp

from . import reference as ref
from ._compare import assert_same
from ._helpers import (
    BACKEND_IDS,
    BACKENDS,
    SEEDS,
    assert_ring,
    canary_of,
    device_for,
    random_canary,
    run_op,
    strided,
    token_ids,
    with_state,
    words_of,
)


def make_inputs(gen: torch.Generator, extend_lens: list[int], with_expected: bool, with_lut: bool,
                tag: int = 0, extra_slots: int = 5) -> dict:
    """Random writes: distinct slots (some 0, negative or past the pool), padding requests on row 0,
    positions mostly prefix_lens + j, seeds mostly valid slots whose stored position precedes the
    first write, some -1, 0 or past the pool; stats and the canary start non-zero."""
    bs = len(extend_lens)
    extend = torch.tensor(extend_lens, dtype=torch.int64)
    woff = offsets_from_lengths(extend)
    n = int(woff[-1])
    num_slots = n + bs + extra_slots + 2
    canary = random_canary(gen, num_slots)
    words = record_words(canary)
    rpi = torch.randint(0, 6, (bs,), generator=gen)
    prefix_lens = torch.randint(0, 30, (bs,), generator=gen)
    req = torch.repeat_interleave(torch.arange(bs), extend)
    j = torch.arange(n) - woff[req]
    positions = prefix_lens[req] + j
    positions += torch.where(torch.rand(n, generator=gen) < 0.1, torch.randint(-2, 3, (n,), generator=gen), 0)
    input_ids = token_ids(gen, n)
    inputs = {}
    if with_lut:  # out_cache_loc indexes a permutation LUT: translated slots stay distinct
        lut = torch.randperm(num_slots + 3, generator=gen)
        loc = torch.randperm(num_slots + 3, generator=gen)[:n]
        written = {int(lut[s]) for s in loc}
        inputs["lut"] = lut
    else:
        loc = torch.randperm(num_slots - 1, generator=gen)[:n] + 1
        written = set(loc.tolist())
    odd = torch.rand(n, generator=gen)
    loc = torch.where(odd < 0.05, 0, torch.where(odd < 0.08, num_slots + 2, torch.where(odd < 0.1, -3, loc)))
    free = [s for s in torch.randperm(num_slots - 1, generator=gen).add(1).tolist() if s not in written]
    seed = torch.tensor(free[:bs], dtype=torch.int64)
    odd = torch.rand(bs, generator=gen)
    seed = torch.where(odd < 0.2, -1, torch.where(odd < 0.25, num_slots + 1, torch.where(odd < 0.3, 0, seed)))
    for r in range(bs):
        if 0 < seed[r] < num_slots and torch.rand(1, generator=gen) < 0.8:
            words[seed[r], POSITION] = prefix_lens[r] - 1
    if with_expected:
        expected = input_ids.clone()
        flip = torch.rand(n, generator=gen) < 0.1
        expected[flip] += 1
        inputs["expected_tokens"] = expected
    ring, counter = new_ring(n + 4)
    counter += int(torch.randint(0, 3, (1,), generator=gen))
    stats = torch.randint(0, 100, new_stats().shape, generator=gen)
    return dict(canary=canary, out_cache_loc=loc, input_ids=input_ids, positions=positions, req_pool_indices=rpi,
                prefix_lens=prefix_lens, write_offsets=woff, seed=seed, ring=ring, ring_counter=counter, stats=stats,
                tag=tag, **inputs)


def expected_stamp(inputs: dict):
    lists = {k: v.tolist() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    return ref.stamp(words_of(inputs["canary"]), lists["out_cache_loc"], lists["input_ids"], lists["positions"],
                     lists["req_pool_indices"], lists["prefix_lens"], lists["write_offsets"], lists["seed"],
                     inputs["tag"], lists.get("expected_tokens"), lists.get("lut"))


def check_all_backends(inputs: dict) -> tuple[list[list[int]], list[list[int]], int]:
    words, rows, stamped = expected_stamp(inputs)
    want_stats = inputs["stats"].clone()
    want_stats[inputs["tag"], STAT_STAMPED] += stamped
    canaries = []
    for backend in BACKENDS:
        args, _ = run_op(stamp, backend, **inputs)
        assert_same(f"canary [{backend.value}]", record_words(args["canary"]), words)
        assert_ring(f"ring [{backend.value}]", args["ring"], args["ring_counter"], inputs["ring"],
                    int(inputs["ring_counter"]), rows)
        assert_same(f"stats [{backend.value}]", args["stats"], want_stats)
        canaries.append(args["canary"].cpu())
    assert_same("canary bytes torch vs triton", canaries[0], canaries[1])
    return words, rows, stamped


@given(seed=SEEDS, extend_lens=st.lists(st.integers(0, 9), max_size=7), with_expected=st.booleans(),
       with_lut=st.booleans(), tag=st.integers(0, 11))
def test_matches_reference(seed, extend_lens, with_expected, with_lut, tag):
    gen = torch.Generator().manual_seed(seed)
    check_all_backends(make_inputs(gen, extend_lens, with_expected, with_lut, tag))


def test_empty_batch_and_empty_extends():
    gen = torch.Generator().manual_seed(1)
    for lens in ([], [0, 0, 0]):
        inputs = make_inputs(gen, lens, with_expected=True, with_lut=False, tag=3)
        words, rows, stamped = check_all_backends(inputs)
        assert (rows, stamped) == ([], 0)


@pytest.mark.parametrize("lens", [[2500], [3, 2500, 1, 40], [1000, 30, 1500, 1, 600], [1024, 1024, 1], [128, 128, 5],
                                  [3, 17000, 40]],
                         ids=["one-2500", "long-among-short", "crossing-blocks", "block-aligned", "small-blocks",
                              "carry-over-two-loads"])
def test_long_requests_carry_the_chain_across_blocks(lens):
    gen = torch.Generator().manual_seed(sum(lens))
    check_all_backends(make_inputs(gen, lens, with_expected=True, with_lut=False, tag=1))


def test_chain_of_a_clean_prefill_is_chain_values():
    tokens = [1, 2, 3, 50256, 0, 17, 17]
    num_slots = 12
    slots = [5, 9, 1, 11, 3, 2, 7]
    for backend in BACKENDS:
        dev = device_for(backend)
        canary = torch.zeros(num_slots, 32, dtype=torch.uint8, device=dev)
        ring, counter = new_ring(4, device=dev)
        stats = new_stats(device=dev)
        i64 = dict(dtype=torch.int64, device=dev)
        # two chunks of one request: 4 tokens from no seed, then 3 continuing from the last slot
        for lo, hi, seed in ((0, 4, -1), (4, 7, slots[3])):
            with_state(stamp, canary=canary, out_cache_loc=torch.tensor(slots[lo:hi], **i64),
                  input_ids=torch.tensor(tokens[lo:hi], **i64), positions=torch.arange(lo, hi, **i64),
                  req_pool_indices=torch.tensor([1], **i64), prefix_lens=torch.tensor([lo], **i64),
                  write_offsets=torch.tensor([0, hi - lo], **i64), seed=torch.tensor([seed], **i64), ring=ring,
                  ring_counter=counter, stats=stats, tag=LaunchTag(LaunchPoint.HEAD).value, backend=backend)
        words = record_words(canary).cpu()
        assert words[slots, CHAIN].tolist() == [to_signed(c) for c in chain_values(tokens)]
        assert words[slots, POSITION].tolist() == list(range(7))
        assert counter.tolist() == [0] and stats[0, STAT_STAMPED].item() == 7 and int(stats.sum()) == 7


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_ring_overflow_keeps_counting(backend):
    """More violations than capacity: the counter holds the true total, the ring is filled, and
    nothing is written past it (the ring is a view of a larger buffer with guard rows)."""
    gen = torch.Generator().manual_seed(7)
    inputs = make_inputs(gen, [40, 5], with_expected=True, with_lut=False, tag=6)
    inputs["expected_tokens"] = inputs["input_ids"] + 1  # every real token is a WRITE_TOKEN violation
    inputs["req_pool_indices"] = torch.tensor([1, 2])
    _, rows, _ = expected_stamp(inputs)
    assert len(rows) == 45
    dev = device_for(backend)
    buf = torch.full((9, 8), -5, dtype=torch.int64, device=dev)
    ring, counter = buf[:6], torch.tensor([2], device=dev)
    ring[:2] = 99  # rows of an earlier launch stay
    args = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with_state(stamp, **{**args, "ring": ring, "ring_counter": counter}, backend=backend)
    assert_ring("ring", ring, counter, torch.tensor([[99] * 8] * 2 + [[-5] * 8] * 4), 2, rows)
    assert buf[6:].cpu().tolist() == [[-5] * 8] * 3
    with_state(stamp, **{**args, "ring": ring, "ring_counter": counter}, backend=backend)
    assert counter.tolist() == [92] and buf[6:].cpu().tolist() == [[-5] * 8] * 3


# --- validation ------------------------------------------------------------------------------

def valid_inputs() -> dict:
    ring, counter = new_ring(4)
    return dict(canary=torch.zeros(8, 32, dtype=torch.uint8), out_cache_loc=torch.tensor([1, 2, 3]),
                input_ids=torch.tensor([5, 6, 7]), positions=torch.tensor([0, 1, 0]),
                req_pool_indices=torch.tensor([1, 2]), prefix_lens=torch.tensor([0, 0]),
                write_offsets=torch.tensor([0, 2, 3]), seed=torch.tensor([-1, -1]), ring=ring, ring_counter=counter,
                stats=new_stats(), tag=0)


I64_ARGS = ["out_cache_loc", "input_ids", "positions", "req_pool_indices", "prefix_lens", "write_offsets", "seed"]
CASES = [
    (dict(canary=torch.zeros(8, 32, dtype=torch.int8)), TypeError, "state.records dtype int8 != uint8"),
    (dict(canary=torch.zeros(8, 16, dtype=torch.uint8)), ValueError,
     "state.records must be uint8[num_slots, 32], got shape"),
    (dict(canary=torch.zeros(256, dtype=torch.uint8)), ValueError, "state.records must be 2-D"),
    *[(dict([(name, valid_inputs()[name].to(torch.int32))]), TypeError, f"{name} dtype int32 != int64")
      for name in I64_ARGS],
    *[(dict([(name, valid_inputs()[name][None])]), ValueError, f"{name} must be 1-D") for name in I64_ARGS],
    (dict(expected_tokens=torch.tensor([5, 6, 7], dtype=torch.int32)), TypeError,
     "expected_tokens dtype int32 != int64"),
    (dict(lut=torch.arange(8, dtype=torch.int32)), TypeError, "lut dtype int32 != int64"),
    (dict(lut=torch.arange(8)[None]), ValueError, "lut must be 1-D"),
    (dict(expected_tokens=torch.tensor([[5, 6, 7]])), ValueError, "expected_tokens must be 1-D"),
    (dict(out_cache_loc=torch.tensor([1, 2])), ValueError, "out_cache_loc length 2 != len(input_ids) (3)"),
    (dict(positions=torch.tensor([0, 1, 0, 1])), ValueError, "positions length 4 != len(input_ids) (3)"),
    (dict(expected_tokens=torch.tensor([5, 6])), ValueError, "expected_tokens length 2 != len(input_ids) (3)"),
    (dict(prefix_lens=torch.tensor([0])), ValueError, "prefix_lens length 1 != bs (2)"),
    (dict(seed=torch.tensor([-1, -1, -1])), ValueError, "seed length 3 != bs (2)"),
    (dict(write_offsets=torch.tensor([0, 3])), ValueError, "write_offsets length 2 != bs+1 (3)"),
    (dict(write_offsets=torch.tensor([1, 2, 3])), ValueError, "write_offsets[0] 1 != 0"),
    (dict(write_offsets=torch.tensor([0, 3, 2])), ValueError, "write_offsets decrease at index 2: 2 < 3"),
    (dict(write_offsets=torch.tensor([0, 2, 4])), ValueError, "write_offsets[-1] 4 != number of tokens (3)"),
    (dict(ring=torch.zeros(4, 8, dtype=torch.int32)), TypeError, "ring dtype int32 != int64"),
    (dict(ring=torch.zeros(4, 7, dtype=torch.int64)), ValueError,
     "state.ring must be int64[capacity, 8], got shape (4, 7)"),
    (dict(ring=torch.zeros(8, 4, dtype=torch.int64).t()), ValueError, "state.ring must be contiguous"),
    (dict(ring_counter=torch.zeros(1, dtype=torch.int32)), TypeError, "ring_counter dtype int32 != int64"),
    (dict(stats=torch.zeros(12, 2, dtype=torch.int64)), ValueError,
     "state.stats must be int64[12, 3], got shape (12, 2)"),
    (dict(stats=torch.zeros(12, 3, dtype=torch.int32)), TypeError, "stats dtype int32 != int64"),
    (dict(tag=12), ValueError, "tag 12 out of range [0, 12); pass LaunchTag(...).value"),
    (dict(tag=-1), ValueError, "tag -1 out of range [0, 12)"),
    (dict(seed=torch.tensor([-1, -1], device="meta")), ValueError, "seed is on the meta device"),
    (dict(ring=new_ring(4, device="meta")[0]), ValueError, "state.ring is on meta but state.records is on cpu"),
    (dict(zip(("ring", "ring_counter"), new_ring(4, device="meta"), strict=True), stats=new_stats("meta")),
     ValueError, "state.ring is on meta but state.records is on cpu"),
]


@pytest.mark.parametrize("change, exc, fragment", CASES)
def test_validation_errors(change, exc, fragment):
    for backend in BACKENDS:
        with pytest.raises(exc) as info:
            with_state(stamp, **{**valid_inputs(), **change}, backend=backend)
        assert fragment in str(info.value)


def test_valid_inputs_pass():
    for backend in BACKENDS:
        args, _ = run_op(stamp, backend, **valid_inputs())
        assert args["ring_counter"].tolist() == [0] and args["stats"][0, STAT_STAMPED].item() == 3


@pytest.mark.parametrize("name", I64_ARGS + ["expected_tokens", "lut", "canary"])
def test_strided_inputs_are_refused_on_every_backend(name):
    """A non-contiguous view is refused by both paths alike (never read as if it were
    contiguous), before anything is written."""
    gen = torch.Generator().manual_seed(8)
    inputs = make_inputs(gen, [3, 0, 4], with_expected=True, with_lut=True, tag=2)
    inputs_canary = inputs["canary"]
    for backend in BACKENDS:
        args = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        if name == "canary":
            buf = torch.zeros(args["canary"].shape[0], 64, dtype=torch.uint8)
            buf[:, :32] = args["canary"]
            args["canary"] = buf[:, :32]
        else:
            args[name] = strided(args[name])
        try:
            with_state(stamp, **args, backend=backend)
        except InputError as e:  # refused on every backend alike, before anything is written
            assert "contiguous" in str(e), (backend, e)
            assert_same(f"canary [{backend.value}]", args["canary"], inputs_canary)
            continue
        raise AssertionError(f"a strided {name} was accepted [{backend.value}]")


def test_canary_of_round_trip():
    canary = random_canary(torch.Generator().manual_seed(9), 5)
    assert_same("canary", canary_of(words_of(canary)), canary)


# --- device-side safety ------------------------------------------------------------------------

@pytest.mark.parametrize("write_offsets", [[-8, 1100, 1200], [-3000, 1100, 1200], [-2**40, 1100, 1200],
                                           [0, -2**40, 1200], [0, 1100, 1150], [0, 1300, 1200], [5, 3, 1200]])
def test_kernel_with_bad_device_offsets_reads_and_writes_only_its_inputs(monkeypatch, write_offsets):
    """Device offsets skip the value checks. Whatever they hold, the kernel must not read outside
    its inputs (the result may not depend on memory around input_ids / positions) nor write
    outside the canary and the ring (guard rows around both)."""
    from kvcanary.ops import gather as gather_mod

    monkeypatch.setattr(gather_mod, "is_host", lambda t: False)  # stamp validates offsets through gather
    gen = torch.Generator().manual_seed(10)
    n, guard, num_slots = 1200, 4096, 1300
    ids, loc = token_ids(gen, n), torch.randperm(num_slots - 1, generator=gen)[:n] + 1
    canary0 = random_canary(gen, num_slots + 4)
    dev = device_for(Backend.TRITON)
    i64 = dict(dtype=torch.int64, device=dev)
    results = []
    for fill in (0, 123456789):
        ids_buf = torch.full((guard + n,), fill, **i64)
        ids_buf[guard:] = ids.to(dev)
        pos_buf = torch.full((guard + n,), fill, **i64)
        pos_buf[guard:] = torch.arange(n, device=dev)
        canary_buf = canary0.to(dev, copy=True)
        ring_buf = torch.full((n + 4, 8), -5, **i64)
        counter, stats = torch.zeros(1, **i64), new_stats(dev)
        with_state(stamp, canary=canary_buf[2:-2], out_cache_loc=loc.to(dev), input_ids=ids_buf[guard:],
              positions=pos_buf[guard:], req_pool_indices=torch.tensor([1, 2], **i64),
              prefix_lens=torch.tensor([0, 1100], **i64), write_offsets=torch.tensor(write_offsets, **i64),
              seed=torch.tensor([-1, -1], **i64), ring=ring_buf[2:-2], ring_counter=counter, stats=stats, tag=0,
              backend=Backend.TRITON)
        assert_same("canary guard rows", torch.cat([canary_buf[:2], canary_buf[-2:]]),
                    torch.cat([canary0[:2], canary0[-2:]]))
        assert_same("ring guard rows", torch.cat([ring_buf[:2], ring_buf[-2:]]), torch.full((4, 8), -5))
        results.append((canary_buf, sorted(ring_buf[2:-2][: int(counter)].tolist()), counter, stats))
    for name, a, b in zip(("canary", "ring", "counter", "stats"), *results, strict=True):
        assert_same(f"{name} with different memory around the inputs", a, b)


def test_the_stamp_block_keeps_the_carry_within_two_loads():
    """BLOCK is the smallest power of two in [128, 1024] with 2 * BLOCK**2 >= T, so the carry of the
    last program (one vector load of BLOCK tails per BLOCK earlier blocks) takes at most two loads;
    from there on BLOCK stays 1024."""
    for n in (0, 1, 4096, 32768, 32769, 131072, 131073, 524288, 524289, 1 << 24):
        block, warps = _stamp_block(n)
        assert block in (128, 256, 512, 1024) and warps == (4 if block == 128 else 8)
        assert block == 1024 or 2 * block * block >= n
        assert block == 128 or 2 * (block // 2) ** 2 < n
        assert block == 1024 or -(-max(-(-n // block), 1) // block) <= 2


def test_a_short_scratch_is_refused_before_anything_is_written():
    inputs = valid_inputs()
    n, before = inputs["input_ids"].shape[0], inputs["canary"].clone()
    for backend in BACKENDS:
        with pytest.raises(InputError, match=rf"scratch length 0 < cdiv\(T, 128\) \({max(-(-n // 128), 1)}\)"):
            with_state(stamp, **inputs, scratch=torch.zeros(0, dtype=torch.int64), backend=backend)
        assert torch.equal(inputs["canary"], before)
