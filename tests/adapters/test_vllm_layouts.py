"""vLLM's cache layouts mapped onto KV sources, on CPU tensors of each layout (no vLLM needed).

A source row of slot ``b * block_size + t`` must be exactly the bytes of token t of block b in
the layout's logical view (every head where the layout keeps a token's heads together, else the
first head), and a fingerprint must change for the slot whose covered bytes change and no other.
"""

from __future__ import annotations

import pytest
import torch

from kvcanary import Half
from kvcanary.adapters.vllm.layouts import (
    Geometry,
    Layout,
    covers_all_heads,
    detect_layout,
    logical_views,
    num_blocks_of,
    sources_for,
)
from kvcanary.adapters.vllm.settings import AdapterSettings
from kvcanary.errors import ConfigError
from kvcanary.ops import DeviceState, FingerprintMode, fingerprint

SHAPES = {
    Layout.CPU: lambda b, n, h, d: (b, h, n, 2 * d),
    Layout.FLASH_ATTN_NHD: lambda b, n, h, d: (2, b, n, h, d),
    Layout.FLASH_ATTN_HND: lambda b, n, h, d: (2, b, h, n, d),
    Layout.FLASHINFER_NHD: lambda b, n, h, d: (b, 2, n, h, d),
    Layout.FLASHINFER_HND: lambda b, n, h, d: (b, 2, h, n, d),
}
CASES = [(layout, dtype, heads) for layout in Layout for dtype in (torch.float32, torch.bfloat16) for heads in (1, 3)]


def _cache(layout: Layout, dtype: torch.dtype, heads: int, seed: int):
    g = Geometry(num_blocks=5, block_size=16, num_heads=heads, head_dim=32)
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(SHAPES[layout](g.num_blocks, g.block_size, heads, g.head_dim), generator=gen).to(dtype)
    return kv, g


def _row_bytes(src, slot: int) -> bytes:
    """The pure-Python reading of a source row: slot -> byte offset by the KVSource formula."""
    raw = src.words.view(torch.uint8)
    start = (slot // src.page_size) * src.page_stride + (slot % src.page_size) * src.bytes_per_token
    return bytes(raw[start: start + src.bytes_per_token].tolist())


@pytest.mark.parametrize("layout,dtype,heads", CASES, ids=lambda x: getattr(x, "value", str(x)))
def test_source_rows_are_the_tokens_bytes(layout, dtype, heads):
    kv, g = _cache(layout, dtype, heads, seed=heads * 7 + len(layout.value))
    k_view, v_view = logical_views(kv, layout, g)
    sources = sources_for([kv], layout, g, (0,), (Half.K, Half.V))
    covered = heads if covers_all_heads(layout, heads) else 1
    assert [(s.half, s.layer, s.num_slots, s.page_size) for s in sources] == \
        [(Half.K, 0, g.num_blocks * g.block_size, g.block_size), (Half.V, 0, g.num_blocks * g.block_size, g.block_size)]
    for src, view in zip(sources, (k_view, v_view), strict=True):
        assert src.bytes_per_token == covered * g.head_dim * kv.element_size()
        for slot in torch.randperm(g.num_blocks * g.block_size, generator=torch.Generator().manual_seed(3))[:25]:
            b, t = divmod(int(slot), g.block_size)
            want = view[b, t, :covered].contiguous().view(torch.uint8).flatten().tolist()
            assert _row_bytes(src, int(slot)) == bytes(want), (layout, src.half, int(slot))


@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.value)
def test_fingerprint_follows_the_covered_bytes(layout):
    heads = 3
    kv, g = _cache(layout, torch.float32, heads, seed=11)
    k_view, v_view = logical_views(kv, layout, g)
    sources = sources_for([kv], layout, g, (0,), (Half.K, Half.V))
    num_slots = g.num_blocks * g.block_size
    state = DeviceState.allocate(num_slots, max_bs=1, max_tokens=num_slots)
    slots = torch.arange(1, num_slots, dtype=torch.int64)

    def prints():
        return fingerprint(slots=slots, sources=sources, mode=FingerprintMode.ALL, state=state).clone()

    before = prints()
    assert int((before == 0).sum()) == 0  # random data: no slot folds to zero
    b, t = 3, 9
    slot = b * g.block_size + t
    v_view[b, t, 0, 5] += 1.0  # a covered byte of one slot
    after = prints()
    assert torch.nonzero(after != before).flatten().add(1).tolist() == [slot]
    k_view[b, t, heads - 1, 0] += 1.0  # the last head: covered only where a token's heads sit together
    last = prints()
    changed = torch.nonzero(last != after).flatten().add(1).tolist()
    assert changed == ([slot] if covers_all_heads(layout, heads) else [])


def test_views_write_through_to_the_cache():
    """The logical views are views (no copy): what a view changes, the cache tensor holds."""
    for layout in Layout:
        kv, g = _cache(layout, torch.float32, 2, seed=5)
        k, v = logical_views(kv, layout, g)
        assert k.data_ptr() >= kv.data_ptr() and v.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
        before = kv.clone()
        v[1, 2, 0, 3] = 1234.5
        assert int((kv != before).sum()) == 1


@pytest.mark.parametrize("layout", [lay for lay in Layout if lay is not Layout.CPU], ids=lambda x: x.value)
def test_detect_layout_from_shape(layout):
    g = Geometry(num_blocks=7, block_size=16, num_heads=4, head_dim=64)
    shape = SHAPES[layout](7, 16, 4, 64)
    assert detect_layout(shape, g) is layout
    assert num_blocks_of(shape, layout) == 7


def test_detect_layout_refuses_ambiguous_and_unknown_shapes():
    g = Geometry(num_blocks=7, block_size=8, num_heads=8, head_dim=64)  # block_size == heads: NHD or HND?
    with pytest.raises(ConfigError, match=r"matches several layouts"):
        detect_layout((2, 7, 8, 8, 64), g)
    with pytest.raises(ConfigError, match=r"shape \[7, 8, 8, 128\] .* matches none"):
        detect_layout((7, 8, 8, 128), g)


def test_logical_views_refuse_a_wrong_shape():
    kv, g = _cache(Layout.FLASH_ATTN_NHD, torch.float32, 2, seed=1)
    with pytest.raises(ConfigError, match=r"flash_attn_hnd must be a contiguous tensor of shape \[2, 5, 2, 16, 32\]"):
        logical_views(kv, Layout.FLASH_ATTN_HND, g)


def test_settings_refuse_unknown_keys_and_values():
    with pytest.raises(ConfigError, match=r"unknown kv-canary keys \['polcy'\]"):
        AdapterSettings.from_extra_config({"polcy": "log"})
    with pytest.raises(ConfigError, match=r"policy must be one of \['log', 'raise', 'recompute'\], got 'off'"):
        AdapterSettings.from_extra_config({"policy": "off"})
    with pytest.raises(ConfigError, match=r"real_kv must be one of \['none', 'partial', 'all'\], got 'some'"):
        AdapterSettings.from_extra_config({"real_kv": "some"})
    with pytest.raises(ConfigError, match=r"sweep_interval must be an int >= 0, got -1"):
        AdapterSettings.from_extra_config({"sweep_interval": -1})
    s = AdapterSettings.from_extra_config({"policy": "RECOMPUTE", "halves": ["v"], "layers": [0, -1, 0]})
    assert (s.policy.value, s.halves, s.layers) == ("recompute", (Half.V,), (0, -1))
    assert AdapterSettings.from_extra_config(s.to_extra_config()) == s


def test_coverage_follows_the_layout():
    default = AdapterSettings()
    assert default.coverage((Half.K, Half.V)) == (FingerprintMode.PARTIAL, (Half.K, Half.V))
    assert default.coverage((Half.V,)) == (FingerprintMode.PARTIAL, (Half.V,))  # the CPU vec kernels
    assert default.coverage(())[0] is FingerprintMode.NONE  # the CPU amx kernels: records only
    explicit = AdapterSettings.from_extra_config({"halves": ["k", "v"]})
    with pytest.raises(ConfigError, match=r"stores \['k'\] of a token scattered .* allows: \['v'\]"):
        explicit.coverage((Half.V,))
    with pytest.raises(ConfigError, match=r"real_kv=all .* allows: none"):
        AdapterSettings.from_extra_config({"real_kv": "all"}).coverage(())
