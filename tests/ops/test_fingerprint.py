from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcanary.core.record import FINGERPRINT, Half, record_words
from kvcanary.errors import InputError
from kvcanary.ops._common import Backend
from kvcanary.ops.fingerprint import FingerprintMode, KVSource, fingerprint, source_meta

from . import reference as ref
from ._compare import assert_same
from ._helpers import (
    BACKEND_IDS,
    BACKENDS,
    SEEDS,
    device_for,
    on_device,
    random_canary,
    random_tags,
    run_op,
    strided,
    with_state,
    words_of,
)

MODES = [FingerprintMode.PARTIAL, FingerprintMode.ALL]


def paged_buffer(gen: torch.Generator, num_slots: int, page_size: int, bytes_per_token: int,
                 dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Random token-major KV bytes [num_pages, page_size, bytes_per_token / itemsize]; no page dim for page size 1."""
    num_pages = -(-num_slots // page_size)
    shape = (num_pages, page_size) if page_size > 1 else (num_pages,)
    raw = torch.randint(0, 256, (*shape, bytes_per_token), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


def strided_source(gen: torch.Generator, num_slots: int, page_size: int, bytes_per_token: int,
                   pad_bytes: int) -> KVSource:
    """A source whose pages are ``pad_bytes`` apart beyond their data (a page-major layout with a gap)."""
    stride = page_size * bytes_per_token + pad_bytes
    num_pages = -(-num_slots // page_size)
    words = torch.randint(-(2**31), 2**31 - 1, (num_pages * stride // 4,), dtype=torch.int32, generator=gen)
    return KVSource(words, num_slots, bytes_per_token, page_size, stride, Half.V, layer=3)


def make_sources(gen: torch.Generator, num_slots: int, layout: list[tuple[int, int, int]]) -> list[KVSource]:
    """One source per (page_size, bytes_per_token, pad_bytes); pad_bytes 0: a plain buffer via from_buffer."""
    out = []
    for i, (page_size, bpt, pad) in enumerate(layout):
        if pad:
            out.append(strided_source(gen, num_slots, page_size, bpt, pad))
        else:
            buf = paged_buffer(gen, num_slots, page_size, bpt, (torch.bfloat16, torch.float32, torch.uint8)[i % 3])
            out.append(KVSource.from_buffer(buf, page_size=page_size, half=Half(i % 2), layer=i // 2))
    return out


def expected(slots: torch.Tensor, sources: list[KVSource], mode: FingerprintMode, canary: torch.Tensor,
             record: bool, tags: torch.Tensor):
    return ref.fingerprint(slots.tolist(), [ref.RefSource.of(s) for s in sources], mode, words_of(canary), record,
                           tags.tolist())


def check_all_backends(slots, sources, mode, canary, record) -> list[int]:
    tags = random_tags(torch.Generator().manual_seed(int(canary.sum())), canary.shape[0])
    want_out, want_words, want_tags = expected(slots, sources, mode, canary, record, tags)
    for backend in BACKENDS:
        out = torch.full_like(slots, -99)
        args, got = run_op(fingerprint, backend, slots=slots, sources=sources, mode=mode, out=out, canary=canary,
                           record=record, source_tags=tags)
        assert got is args["out"]
        assert_same(f"fingerprint [{backend.value}, {mode.name}]", got, want_out)
        assert_same(f"canary [{backend.value}, {mode.name}, record={record}]", record_words(args["canary"]),
                    want_words)
        assert_same(f"side words [{backend.value}, {mode.name}, record={record}]", args["source_tags"], want_tags)
    return want_out


LAYOUT = st.lists(st.tuples(st.sampled_from([1, 1, 2, 4, 16]), st.sampled_from([16, 32, 48, 528]),
                            st.sampled_from([0, 0, 16, 48])), min_size=1, max_size=4)


@given(seed=SEEDS, n=st.integers(0, 40), num_slots=st.integers(2, 45), layout=LAYOUT, mode=st.sampled_from(MODES),
       record=st.booleans())
def test_matches_reference(seed, n, num_slots, layout, mode, record):
    gen = torch.Generator().manual_seed(seed)
    sources = make_sources(gen, num_slots + int(torch.randint(0, 3, (1,), generator=gen)), layout)
    slots = torch.randint(-3, num_slots + 3, (n,), generator=gen)
    check_all_backends(slots, sources, mode, random_canary(gen, num_slots), record)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_k_and_v_of_two_layers(page_size, mode):
    gen = torch.Generator().manual_seed(page_size)
    num_slots = 37  # odd, not a multiple of the page size
    sources = make_sources(gen, num_slots, [(page_size, 256, 0)] * 4)
    slots = torch.cat([torch.arange(-1, num_slots + 2), torch.tensor([5, 5, 0])])
    out = check_all_backends(slots, sources, mode, random_canary(gen, num_slots), record=True)
    for s, fp in zip(slots.tolist(), out, strict=True):
        assert (fp == 0) == (not 0 < s < num_slots), (s, fp)  # slots -1, 0 and past the pool give 0
    assert len(set(out[2:num_slots + 1])) == num_slots - 1  # every real slot differs


def test_mode_none_gives_and_records_zeros():
    gen = torch.Generator().manual_seed(2)
    sources = make_sources(gen, 9, [(1, 32, 0)])
    canary = random_canary(gen, 9)
    slots = torch.tensor([3, 0, 8, 12, 3])
    for backend in BACKENDS:
        args, out = run_op(fingerprint, backend, slots=slots, sources=sources, mode=FingerprintMode.NONE,
                           canary=canary, record=True)
        assert out.tolist() == [0] * 5
        words = record_words(args["canary"]).cpu()
        assert words[[3, 8], FINGERPRINT].tolist() == [0, 0]
        keep = [i for i in range(9) if i not in (3, 8)]
        assert_same("other records", words[keep], record_words(canary)[keep])


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_every_single_byte_flip_is_seen_in_the_bytes_the_mode_reads(mode):
    gen = torch.Generator().manual_seed(3)
    bpt = 64
    buf = paged_buffer(gen, 6, 2, bpt, torch.uint8)
    src = KVSource.from_buffer(buf, page_size=2)
    canary = random_canary(gen, 6)
    slot = torch.tensor([3])
    base = with_state(fingerprint, slots=slot, sources=[src], mode=mode, canary=canary)
    flat = buf.view(-1)
    for byte in range(bpt):
        for bit in (0, 7):
            flat[3 * bpt + byte] ^= 1 << bit
            for backend in BACKENDS:
                _, got = run_op(fingerprint, backend, slots=slot, sources=[src], mode=mode, canary=canary)
                seen = mode is FingerprintMode.ALL or byte < 16
                assert (got.item() != base.item()) == seen, (backend, byte, bit)
            flat[3 * bpt + byte] ^= 1 << bit


def test_precomputed_meta_gives_the_same_values():
    gen = torch.Generator().manual_seed(4)
    sources = make_sources(gen, 20, [(4, 32, 0), (1, 48, 16)])
    canary = random_canary(gen, 20)
    slots = torch.arange(20)
    for mode in MODES:
        want = with_state(fingerprint, slots=slots, sources=sources, mode=mode, canary=canary, backend=Backend.TORCH)
        args, got = run_op(fingerprint, Backend.TRITON, slots=slots, sources=sources, mode=mode, canary=canary,
                           meta=source_meta(sources, mode, device_for(Backend.TRITON)))
        assert_same(f"with meta [{mode.name}]", got, want)


def test_many_slots_and_wide_rows():
    gen = torch.Generator().manual_seed(5)
    num_slots = 301
    sources = make_sources(gen, num_slots, [(16, 1024, 0), (1, 1040, 32)])
    slots = torch.randint(-2, num_slots + 2, (700,), generator=gen)
    for mode in MODES:
        check_all_backends(slots, sources, mode, random_canary(gen, num_slots), record=True)


# --- validation ------------------------------------------------------------------------------

def valid_args() -> dict:
    buf = torch.zeros(8, 32, dtype=torch.uint8)
    return dict(slots=torch.tensor([1, 2, 0]), sources=[KVSource.from_buffer(buf)], mode=FingerprintMode.ALL,
                canary=torch.zeros(8, 32, dtype=torch.uint8))


@pytest.mark.parametrize("change, exc, fragment", [
    (dict(slots=torch.tensor([1, 2, 0], dtype=torch.int32)), TypeError, "slots dtype int32 != int64"),
    (dict(slots=torch.tensor([[1, 2, 0]])), ValueError, "slots must be 1-D"),
    (dict(canary=None), TypeError, "state.records must be a torch.Tensor, got NoneType"),
    (dict(canary=torch.zeros(8, 32, dtype=torch.int64)), TypeError, "state.records dtype int64 != uint8"),
    (dict(canary=torch.zeros(8, 24, dtype=torch.uint8)), ValueError,
     "state.records must be uint8[num_slots, 32], got shape"),
    (dict(mode=2), TypeError, "mode must be a FingerprintMode, got 2"),
    (dict(out=torch.zeros(3, dtype=torch.int32)), TypeError, "out dtype int32 != int64"),
    (dict(out=torch.zeros(3, 1, dtype=torch.int64)), ValueError, "out must be 1-D"),
    (dict(out=torch.zeros(2, dtype=torch.int64)), ValueError, "out length 2 != len(slots) (3)"),
    (dict(slots=torch.tensor([1, 2, 0], device="meta")), ValueError, "slots is on the meta device"),
    (dict(sources=[KVSource.from_buffer(torch.zeros(8, 32, dtype=torch.uint8))] * 5), ValueError,
     "5 KV sources > 4"),
    (dict(sources=[torch.zeros(8, 32)]), TypeError, "sources[0] must be a KVSource, got Tensor"),
    (dict(sources=[KVSource.from_buffer(torch.zeros(7, 32, dtype=torch.uint8))]), ValueError,
     "sources[0] covers 7 slots < the canary's 8"),
])
def test_validation_errors(change, exc, fragment):
    for backend in BACKENDS:
        with pytest.raises(exc) as info:
            with_state(fingerprint, **{**valid_args(), **change}, backend=backend)
        assert fragment in str(info.value)


@pytest.mark.parametrize("kwargs, exc, fragment", [
    (dict(words=torch.zeros(64, dtype=torch.int64)), TypeError, "KVSource.words dtype int64 != int32"),
    (dict(words=torch.zeros(8, 8, dtype=torch.int32)), ValueError, "KVSource.words must be 1-D"),
    (dict(bytes_per_token=24), ValueError, "bytes_per_token 24 must be a positive multiple of 16"),
    (dict(bytes_per_token=0), ValueError, "bytes_per_token 0 must be a positive multiple of 16"),
    (dict(page_size=0), ValueError, "page_size 0 < 1"),
    (dict(page_size=2, page_stride_bytes=48), ValueError,
     "page_stride_bytes 48 must be a multiple of 16 and >= page_size * bytes_per_token (64)"),
    (dict(page_size=2, page_stride_bytes=72), ValueError, "page_stride_bytes 72 must be a multiple of 16"),
    (dict(words=torch.zeros(65, dtype=torch.int32)[1:]), ValueError, "KV source storage is not 16-byte aligned"),
    (dict(num_slots=9), ValueError, "KV source holds 256 bytes, but 9 slots need 288"),
])
def test_kv_source_errors(kwargs, exc, fragment):
    base = dict(words=torch.zeros(64, dtype=torch.int32), num_slots=8, bytes_per_token=32)
    with pytest.raises(exc) as info:
        KVSource(**{**base, **kwargs})
    assert fragment in str(info.value)


def test_kv_source_from_buffer():
    src = KVSource.from_buffer(torch.zeros(5, 4, 8, dtype=torch.bfloat16), page_size=4)  # [pages, page, ...]
    assert (src.num_slots, src.bytes_per_token, src.page_stride) == (20, 16, 64)
    src = KVSource.from_buffer(torch.zeros(5, 3, 8, dtype=torch.bfloat16), page_size=4)  # token-major
    assert (src.num_slots, src.bytes_per_token, src.page_stride) == (5, 48, 192)
    assert (src.words_read(FingerprintMode.PARTIAL), src.words_read(FingerprintMode.ALL)) == (4, 12)
    assert src.words_read(FingerprintMode.NONE) == 0
    with pytest.raises(ValueError, match="KV buffer must be contiguous"):
        KVSource.from_buffer(torch.zeros(8, 4, dtype=torch.int32).t())
    with pytest.raises(ValueError, match=r"does not split into 0 token rows"):
        KVSource.from_buffer(torch.zeros(0, 4, dtype=torch.int32))


@pytest.mark.parametrize("name", ["slots", "out", "canary"])
def test_strided_inputs_are_refused_on_every_backend(name):
    """A non-contiguous view is refused by both paths alike, before anything is written."""
    gen = torch.Generator().manual_seed(6)
    sources = make_sources(gen, 12, [(2, 32, 0)])
    canary = random_canary(gen, 12)
    slots = torch.randint(-1, 14, (9,), generator=gen)
    inputs_canary = canary
    for backend in BACKENDS:
        args = dict(slots=slots.clone(), out=torch.zeros(9, dtype=torch.int64), canary=canary.clone())
        if name == "canary":
            buf = torch.zeros(12, 64, dtype=torch.uint8)
            buf[:, :32] = canary
            args["canary"] = buf[:, :32]
        else:
            args[name] = strided(args[name])
        try:
            with_state(fingerprint, **args, sources=sources, mode=FingerprintMode.ALL, record=True, backend=backend)
        except InputError as e:  # refused on every backend alike, before anything is written
            assert "contiguous" in str(e), (backend, e)
            assert_same(f"canary [{backend.value}]", args["canary"], inputs_canary)
            continue
        raise AssertionError(f"a strided {name} was accepted [{backend.value}]")


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_record_writes_only_valid_slots(backend):
    """Slots <= 0 or >= num_slots are skipped: guard rows around the canary stay as they were."""
    gen = torch.Generator().manual_seed(7)
    sources = make_sources(gen, 14, [(1, 32, 0)])
    buf = random_canary(gen, 14)
    before = buf.clone()
    dev = device_for(backend)
    buf = buf.to(dev)
    slots = torch.tensor([-2, -1, 0, 1, 10, 11, 12, 2**40], device=dev)
    with_state(fingerprint, slots=slots, sources=on_device(sources, dev), mode=FingerprintMode.ALL,
               canary=buf[2:-2], record=True, backend=backend)
    buf = buf.cpu()
    changed = (buf != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [3]  # slot 1 of the 10-slot view; 10, 11, 12 and 2**40 are past it


def test_sources_without_data_or_with_strided_words_are_refused():
    with pytest.raises(InputError, match="KVSource.words is on the meta device"):
        KVSource.from_buffer(torch.zeros(8, 32, dtype=torch.uint8, device="meta"))
    words = torch.zeros(64, dtype=torch.int32)
    with pytest.raises(InputError, match=r"KVSource.words must be a contiguous int32 view \(stride 1\), got stride 2"):
        KVSource(words[::2], 2, 16)
    with pytest.raises(InputError, match="got stride 0"):
        KVSource(words[:1].expand(16), 2, 16)
