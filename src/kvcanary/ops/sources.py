"""KV sources: the buffers of a pool a canary fingerprints, their table, and ``SourceSet``, the
sources one state covers with their mode and table, checked once (as ``DeviceState`` is for
device state).

A KV source is one buffer of the pool (say layer 0's K) seen as int32 words. Slot s starts at
byte ``(s // page_size) * page_stride + (s % page_size) * bytes_per_token``; token-major layouts
(``[num_slots, heads, dim]`` or ``[num_pages, page_size, heads, dim]``) have
``page_stride = page_size * bytes_per_token``. Rows are 16-byte aligned.

Every op that reads K/V takes ``sources`` with a ``mode`` and, optionally, their ``meta``
(``source_meta``): under ``FingerprintMode.NONE`` no source is read; the rest must be
``KVSource`` views on the state's device covering its slots, at most ``MAX_SOURCES``, and the
table must match them. ``SourceSet.build`` makes those checks once; an op given a ``SourceSet``
as ``sources`` takes its sources, mode and table as they are (``resolve``), without checking
them again. A caller that launches every step (a Canary) builds one and passes it down.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcanary.core.record import MAX_SOURCES, FingerprintMode, Half
from kvcanary.errors import InputError, InputTypeError
from kvcanary.ops._common import Validated, check_tensor, is_host, layout_key

PARTIAL_BYTES = 16


@dataclass(frozen=True)
class KVSource:
    """One buffer of the pool as int32 words (``words``: a 1-D int32 tensor over the buffer's
    storage; the source keeps it as a tensor of its own, whose version counter the model's writes
    into the buffer do not move)."""

    words: torch.Tensor
    num_slots: int
    bytes_per_token: int
    page_size: int = 1
    page_stride_bytes: int = 0
    half: Half = Half.K
    layer: int = 0

    def __post_init__(self):
        check_tensor("KVSource.words", self.words, torch.int32, 1)
        if self.words.numel() > 1 and self.words.stride(0) != 1:
            raise InputError(f"KVSource.words must be a contiguous int32 view (stride 1), got stride "
                             f"{self.words.stride(0)}; build it with KVSource.from_buffer(buffer)")
        if self.words.device.type == "meta":
            raise InputError("KVSource.words is on the meta device, which holds no data")
        object.__setattr__(self, "words", _own_words(self.words))
        for name in ("num_slots", "bytes_per_token", "page_size", "page_stride_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise InputTypeError(f"KVSource.{name} must be an int, got {type(v).__name__}")
        if self.num_slots < 1 or self.page_stride_bytes < 0:
            raise InputError(f"KVSource num_slots {self.num_slots} must be >= 1 and page_stride_bytes "
                             f"{self.page_stride_bytes} >= 0")
        if self.bytes_per_token <= 0 or self.bytes_per_token % 16:
            raise InputError(f"bytes_per_token {self.bytes_per_token} must be a positive multiple of 16")
        if self.page_size < 1:
            raise InputError(f"page_size {self.page_size} < 1")
        stride = self.page_stride_bytes or self.page_size * self.bytes_per_token
        if stride % 16 or stride < self.page_size * self.bytes_per_token:
            raise InputError(f"page_stride_bytes {stride} must be a multiple of 16 and >= page_size * "
                             f"bytes_per_token ({self.page_size * self.bytes_per_token})")
        if self.words.data_ptr() % 16:
            raise InputError("KV source storage is not 16-byte aligned; pass the pool buffer itself, "
                             "not an offset view")
        last = (self.num_slots - 1) // self.page_size * stride + (self.num_slots - 1) % self.page_size * \
            self.bytes_per_token + self.bytes_per_token
        if last > self.words.numel() * 4:
            raise InputError(f"KV source holds {self.words.numel() * 4} bytes, but {self.num_slots} slots need {last}")
        object.__setattr__(self, "_key", self._geometry())

    def _geometry(self) -> tuple:
        return (*layout_key((self.words,)), self.num_slots, self.bytes_per_token, self.page_size,
                self.page_stride_bytes, self.half)

    def check(self, name: str = "KVSource") -> None:
        """The per-call check: the words and the geometry validated at construction, unchanged (a
        resized or restrided ``words``, another slot count, row size, page size or page stride)."""
        now = self._geometry()
        if now != self._key:
            what = ("address", "length", "strides", "dtype", "num_slots", "bytes_per_token", "page_size",
                    "page_stride_bytes", "half")
            diff = ", ".join(f"{w} {_plain(a)} -> {_plain(b)}" for w, a, b in zip(what, self._key, now, strict=True)
                             if a != b and w != "address") or "moved to another address"
            raise InputError(f"{name} changed since it was built ({diff}); build a new KVSource "
                             "(KVSource.from_buffer) and SourceSet for the buffer as it is now")

    @property
    def page_stride(self) -> int:
        return self.page_stride_bytes or self.page_size * self.bytes_per_token

    def words_read(self, mode: FingerprintMode) -> int:
        if mode is FingerprintMode.NONE:
            return 0
        n = PARTIAL_BYTES if mode is FingerprintMode.PARTIAL else self.bytes_per_token
        return min(n, self.bytes_per_token) // 4

    @classmethod
    def from_buffer(cls, buffer: torch.Tensor, page_size: int = 1, half: Half = Half.K, layer: int = 0) -> KVSource:
        """A source over a contiguous token-major buffer ``[num_slots, ...]`` or ``[num_pages, page_size, ...]``."""
        if not buffer.is_contiguous():
            raise InputError(f"KV buffer must be contiguous, got strides {buffer.stride()}")
        paged = page_size > 1 and buffer.dim() >= 2 and buffer.shape[1] == page_size
        num_slots = buffer.shape[0] * (page_size if paged else 1)
        nbytes = buffer.numel() * buffer.element_size()
        if num_slots == 0 or nbytes % num_slots:
            raise InputError(f"KV buffer of shape {tuple(buffer.shape)} does not split into {num_slots} token rows")
        return cls(buffer.view(-1).view(torch.uint8).view(torch.int32), num_slots, nbytes // num_slots, page_size,
                   0, half, layer)


def _own_words(words: torch.Tensor) -> torch.Tensor:
    """``words`` as a tensor of the source's own: the same storage, offset, sizes and strides, but
    a version counter of its own. A view shares its base's counter, which the model's K/V writes
    move at every forward; this one moves only when the words themselves are changed in place
    (``resize_``, ``set_``, ``as_strided_``), so a bound launch sees an unchanged source from
    three reads (``ops._common.BoundBuffers``). A storage that grows (a ``resize_`` of the
    buffer) moves under both, and its address with it."""
    own = torch.empty(0, dtype=words.dtype, device=words.device)
    return own.set_(words.untyped_storage(), words.storage_offset(), words.shape, words.stride())


def _plain(v) -> str:
    return str(list(v)) if isinstance(v, torch.Size) else str(v).removeprefix("torch.")


def canonical_device(device) -> torch.device:
    """``device`` with its index: ``cuda`` and ``cuda:0`` name one device (on a machine whose current
    device is 0), and tensors report the indexed form."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def validate_sources(sources, num_slots: int, device: torch.device) -> None:
    if len(sources) > MAX_SOURCES:
        raise InputError(f"{len(sources)} KV sources > {MAX_SOURCES}; cover fewer layers per fingerprint group")
    for i, src in enumerate(sources):
        if not isinstance(src, KVSource):
            raise InputTypeError(f"sources[{i}] must be a KVSource, got {type(src).__name__}")
        src.check(f"sources[{i}]")
        if src.words.device != canonical_device(device):
            raise InputError(f"sources[{i}] is on {src.words.device} but the canary is on {device}")
        if src.num_slots < num_slots:
            raise InputError(f"sources[{i}] covers {src.num_slots} slots < the canary's {num_slots}")


# --- torch ---------------------------------------------------------------------------------


def source_meta(sources, mode: FingerprintMode, device) -> torch.Tensor:
    """The int64[4, 4] table the kernels read: per source (page_size, page_stride_words,
    token_words, words_read). Build it once and pass it as ``meta`` inside CUDA graphs."""
    meta = torch.zeros(MAX_SOURCES, 4, dtype=torch.int64)
    for i, src in enumerate(sources):
        meta[i] = torch.tensor([src.page_size, src.page_stride // 4, src.bytes_per_token // 4, src.words_read(mode)])
    return meta.to(device)


def validate_meta(meta, sources, mode: FingerprintMode, device) -> torch.Tensor | None:
    """``meta`` as passed (or built from the sources when None): int64[4, 4], contiguous, on
    ``device``; on the host its values must be those ``source_meta`` gives (the torch path
    reads the sources themselves, so a stale table would make the backends disagree)."""
    if not sources:
        return None
    if meta is None:
        return source_meta(sources, mode, device)
    check_tensor("meta", meta, torch.int64, 2)
    if tuple(meta.shape) != (MAX_SOURCES, 4) or not meta.is_contiguous():
        raise InputError(f"meta must be a contiguous int64[{MAX_SOURCES}, 4], got shape {tuple(meta.shape)} strides "
                         f"{meta.stride()}; build it with source_meta(sources, mode, device)")
    if meta.device != canonical_device(device):
        raise InputError(f"meta is on {meta.device} but the state is on {device}")
    if is_host(meta):
        # the table's values follow from these alone: an unchanged meta that matched them matches
        shape = (mode, tuple((s.page_size, s.page_stride, s.bytes_per_token) for s in sources))
        if _META_VALIDATED.seen(meta, (meta,), shape):
            return meta
        want = source_meta(sources, mode, device)
        if not torch.equal(meta, want):
            raise InputError(f"meta {meta[:len(sources)].tolist()} != source_meta(sources, mode) "
                             f"{want[:len(sources)].tolist()}; rebuild it when the sources or the mode change")
        _META_VALIDATED.remember(meta, (meta,), shape)
    return meta


_META_VALIDATED = Validated()


@dataclass(frozen=True, eq=False)
class SourceSet:
    """``sources`` (none under ``FingerprintMode.NONE``), their ``mode`` and their ``meta``
    (int64[MAX_SOURCES, 4] on ``device``; None without sources), checked for a state of at least
    ``num_slots`` slots on ``device``. Build it with ``SourceSet.build``."""

    sources: tuple[KVSource, ...]
    mode: FingerprintMode
    meta: torch.Tensor | None
    num_slots: int
    device: torch.device

    @classmethod
    def build(cls, sources: Sequence[KVSource], mode: FingerprintMode, num_slots: int, device: torch.device,
              meta: torch.Tensor | None = None) -> SourceSet:
        """The checked bundle; raises InputTypeError / InputError for a mode that is no
        FingerprintMode, a source that is no KVSource, on another device or covering fewer slots,
        more than MAX_SOURCES, or a ``meta`` that does not match them."""
        if not isinstance(mode, FingerprintMode):
            raise InputTypeError(f"mode must be a FingerprintMode, got {mode!r}")
        if not isinstance(sources, list | tuple):
            raise InputTypeError(f"sources must be a list of KVSource or a SourceSet, got {type(sources).__name__}")
        kept = list(sources) if mode is not FingerprintMode.NONE else []
        device = canonical_device(device)
        validate_sources(kept, num_slots, device)
        return cls(tuple(kept), mode, validate_meta(meta, kept, mode, device), num_slots, device)

    @classmethod
    def resolve(cls, sources, mode: FingerprintMode, meta: torch.Tensor | None, num_slots: int,
                device: torch.device) -> SourceSet:
        """``sources`` as a SourceSet: one given is taken as built (its own mode and meta; it must
        be for this device and cover ``num_slots``), else one is built (``build``)."""
        if not isinstance(sources, SourceSet):
            return cls.build(sources, mode, num_slots, device, meta)
        if sources.device != canonical_device(device) or sources.num_slots < num_slots:
            raise InputError(f"SourceSet built for {sources.num_slots} slots on {sources.device}, used for "
                             f"{num_slots} on {device}; build one for this state")
        sources.check()
        return sources

    def check(self) -> None:
        """The per-call check of a SourceSet taken as built: each source's words and geometry
        (``KVSource.check``) and the table's layout, unchanged since ``build``."""
        for i, src in enumerate(self.sources):
            src.check(f"sources[{i}]")
        if self.meta is not None and layout_key((self.meta,)) != self._meta_key:
            raise InputError("the SourceSet's meta was resized, restrided or replaced since it was built; "
                             "build a new SourceSet")
        if self.meta is not None and is_host(self.meta):  # its values too (unchanged: one memo lookup)
            validate_meta(self.meta, self.sources, self.mode, self.device)

    def __post_init__(self):
        object.__setattr__(self, "_meta_key", layout_key((self.meta,)) if self.meta is not None else ())

    def list(self) -> list[KVSource]:
        return list(self.sources)
