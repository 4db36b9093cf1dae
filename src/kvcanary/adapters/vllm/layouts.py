"""Where vLLM keeps a token's K and V, for the cache layouts the adapter covers, as KV sources.

Every layout is read through one logical view per half, ``[blocks, block_size, heads, head_dim]``
(a strided view of the layer's cache tensor, no copy), and becomes a ``KVSource``: slot
``s = block * block_size + offset`` starts at byte ``block * page_stride + offset * row_bytes``.

| backend            | layer tensor                                | K view (logical)            | heads in a row |
|--------------------|---------------------------------------------|-----------------------------|----------------|
| CPU_ATTN (0.32)    | ``[B, H, N, 2*D]``: per block and head, the | ``kv.view(B,H,2N,D)[:,:,:N]``| first head     |
|                    | N tokens' K, then their V (see below)       | permuted to ``[B,N,H,D]``   |                |
| FLASH_ATTN, NHD    | ``[2, B, N, H, D]``                         | ``kv[0]``                   | all            |
| FLASH_ATTN, HND    | ``[2, B, H, N, D]``                         | ``kv[0].transpose(1, 2)``   | first head     |
| FLASHINFER, NHD    | ``[B, 2, N, H, D]``                         | ``kv[:, 0]``                | all            |
| FLASHINFER, HND    | ``[B, 2, H, N, D]``                         | ``kv[:, 0].transpose(1, 2)``| first head     |

A source row must be contiguous bytes: where a token's heads are adjacent (NHD) the row is the
whole token (every head); where a block keeps each head's tokens together (HND, the CPU layout)
the row is the first head's ``head_dim`` values, so ``real_kv=all`` fingerprints that head and
``partial`` its first 16 bytes (as on the NHD layouts, where the first 16 bytes are also the
first head's). The record checks (token, position, chain) do not depend on the layout.

vLLM's CPU kernels order the inside of a block by instruction set: with the ``vec`` kernels
(fp32) a block keeps V by token (``[N, D]``) but K by dimension (``[D, N]``: one token's K is
spread over the block), with ``amx`` (bf16 on AMX machines) neither is by token. A half that is
not stored by token cannot be a KV source; which halves are is found at startup by writing one
token with vLLM's own cache kernel and reading it back (``cpu_probe``), so the adapter never
fingerprints bytes it only assumes to be a token's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from kvcanary import Half, KVSource
from kvcanary.errors import ConfigError


class Layout(enum.Enum):
    CPU = "cpu"
    FLASH_ATTN_NHD = "flash_attn_nhd"
    FLASH_ATTN_HND = "flash_attn_hnd"
    FLASHINFER_NHD = "flashinfer_nhd"
    FLASHINFER_HND = "flashinfer_hnd"


@dataclass(frozen=True)
class Geometry:
    """A layer's cache geometry: blocks, tokens per block, KV heads, head dim."""

    num_blocks: int
    block_size: int
    num_heads: int
    head_dim: int


def logical_views(kv: torch.Tensor, layout: Layout, geometry: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V views ``[blocks, block_size, heads, head_dim]`` of one layer's cache tensor."""
    b, n, h, d = geometry.num_blocks, geometry.block_size, geometry.num_heads, geometry.head_dim
    expected = {
        Layout.CPU: (b, h, n, 2 * d),
        Layout.FLASH_ATTN_NHD: (2, b, n, h, d),
        Layout.FLASH_ATTN_HND: (2, b, h, n, d),
        Layout.FLASHINFER_NHD: (b, 2, n, h, d),
        Layout.FLASHINFER_HND: (b, 2, h, n, d),
    }[layout]
    if tuple(kv.shape) != expected or not kv.is_contiguous():
        raise ConfigError(f"vLLM KV cache for layout {layout.value} must be a contiguous tensor of shape "
                          f"{list(expected)}, got shape {list(kv.shape)} strides {list(kv.stride())}; the adapter "
                          "covers the layouts in kvcanary.adapters.vllm.layouts")
    if layout is Layout.CPU:
        halves = kv.view(b, h, 2 * n, d)
        k, v = halves[:, :, :n], halves[:, :, n:]
        return k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    if layout is Layout.FLASH_ATTN_NHD:
        return kv[0], kv[1]
    if layout is Layout.FLASH_ATTN_HND:
        return kv[0].transpose(1, 2), kv[1].transpose(1, 2)
    if layout is Layout.FLASHINFER_NHD:
        return kv[:, 0], kv[:, 1]
    return kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)


def source_of(view: torch.Tensor, half: Half, layer: int) -> KVSource:
    """A KVSource over a logical ``[blocks, block_size, heads, head_dim]`` view of one half.

    The row is every head where a token's heads are adjacent in memory, else the first head."""
    b, n, h, d = view.shape
    elt = view.element_size()
    sb, sn, sh, sd = view.stride()
    if sd != 1:
        raise ConfigError(f"vLLM KV view of layer {layer} has head_dim stride {sd} != 1; not a layout the adapter "
                          "covers")
    all_heads = h == 1 or sh == d
    row_bytes = (h * d if all_heads else d) * elt
    if sn * elt != row_bytes:
        raise ConfigError(f"vLLM KV view of layer {layer}: tokens of a block are {sn * elt} bytes apart, rows are "
                          f"{row_bytes} bytes; not a layout the adapter covers")
    storage = view.untyped_storage()
    start = view.storage_offset() * elt
    nbytes = (storage.nbytes() - start) // 4 * 4
    words = torch.empty(0, dtype=torch.uint8, device=view.device)
    words.set_(storage, start, (nbytes,), (1,))
    return KVSource(words.view(torch.int32), num_slots=b * n, bytes_per_token=row_bytes, page_size=n,
                    page_stride_bytes=sb * elt, half=half, layer=layer)


def sources_for(kv_by_layer: list[torch.Tensor], layout: Layout, geometry: Geometry, layers: tuple[int, ...],
                halves: tuple[Half, ...]) -> list[KVSource]:
    """The KV sources of ``layers`` x ``halves`` (indexes into ``kv_by_layer``, negatives from the end)."""
    sources = []
    for index in layers:
        if not -len(kv_by_layer) <= index < len(kv_by_layer):
            raise ConfigError(f"kv-canary layers: layer {index} is outside the {len(kv_by_layer)} layers of this KV "
                              "cache group")
        k, v = logical_views(kv_by_layer[index], layout, geometry)
        for half in halves:
            sources.append(source_of(k if half is Half.K else v, half, index % len(kv_by_layer)))
    return sources


def num_blocks_of(shape: tuple[int, ...], layout: Layout) -> int:
    return shape[1] if layout in (Layout.FLASH_ATTN_NHD, Layout.FLASH_ATTN_HND) else shape[0]


def fingerprintable(layout: Layout, cpu_halves: tuple[Half, ...] = ()) -> tuple[Half, ...]:
    """The halves whose token rows a layout stores as one run of bytes (on the CPU: found by probing)."""
    return cpu_halves if layout is Layout.CPU else (Half.K, Half.V)


def covers_all_heads(layout: Layout, num_heads: int) -> bool:
    return num_heads == 1 or layout in (Layout.FLASH_ATTN_NHD, Layout.FLASHINFER_NHD)


def detect_layout(shape: tuple[int, ...], geometry: Geometry) -> Layout:
    """A GPU layer cache's layout from its shape (the FlashAttention and FlashInfer layouts)."""
    b, n, h, d = geometry.num_blocks, geometry.block_size, geometry.num_heads, geometry.head_dim
    candidates = (((2, b, n, h, d), Layout.FLASH_ATTN_NHD), ((2, b, h, n, d), Layout.FLASH_ATTN_HND),
                  ((b, 2, n, h, d), Layout.FLASHINFER_NHD), ((b, 2, h, n, d), Layout.FLASHINFER_HND))
    found = {layout for s, layout in candidates if s == tuple(shape)}
    if len(found) != 1:
        what = "matches several layouts" if found else "matches none of the layouts"
        raise ConfigError(f"kv-canary: a vLLM KV cache of shape {list(shape)} (blocks={b}, block_size={n}, "
                          f"kv_heads={h}, head_dim={d}) {what} the adapter covers: FlashAttention [2, B, N, H, D] or "
                          "[2, B, H, N, D], FlashInfer [B, 2, N, H, D] or [B, 2, H, N, D], CPU [B, H, N, 2D]")
    return found.pop()
