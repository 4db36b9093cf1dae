"""The layout signature of travelling rows: what an ``export_rows`` row means.

A row (``ROW_BYTES``: a record and its source-tag side word) is meaningful only against the layout
it was written for: the record version, the covered KV sources in order (their layers and halves:
bit ``16i`` of a side word and the fingerprint fold belong to source ``i``), the page size, the
K/V dtype and head geometry the fingerprints were folded over, the fingerprint mode, and the model.
A receiver whose layout differs would verify the rows against other bytes: false alarms at best,
damage read as clean at worst. Every move of rows between canaries (``import_rows``/``land_rows``,
a host mirror adopted by ``attach_host_tier``, a prefill/decode transfer, a vLLM worker) compares
the sender's signature with the receiver's and refuses a mismatch before anything is written:

    import_rows: signature mismatch: layers sender (0, 0, 31, 31) receiver (0, 0, 15, 15)

``None`` is a value of its own ("not given"): a sender that names its model and a receiver that
does not differ. A sender that does not decide some fields (a vLLM scheduler sends blocks, not
records: which layers and halves the workers fingerprint is theirs to choose) leaves them None,
and the receiver compares the others (``check(..., names=...)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from kvcanary.core.record import RECORD_VERSION, FingerprintMode, Half
from kvcanary.errors import KVCanaryError


def dtype_name(dtype: torch.dtype | str | None) -> str | None:
    """``torch.bfloat16`` -> ``"bfloat16"`` (a string travels through any pickle); None stays None."""
    if dtype is None or isinstance(dtype, str):
        return dtype
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class LayoutSignature:
    """What the rows of one canary mean (see the module doc). Build it with ``of`` (the Canary
    does, once: ``Canary.signature``); compare with ``check``. ``layers`` and ``halves`` are per
    KV source, in the sources' order (K and V of layers 0 and 31: ``(0, 0, 31, 31)`` and
    ``(K, V, K, V)``)."""

    record_version: int
    layers: tuple[int, ...] | None
    halves: tuple[Half, ...] | None
    page_size: int | None
    dtype: str | None
    num_kv_heads: int | None
    head_dim: int | None
    fingerprint: FingerprintMode | None
    model: str | None = None

    @classmethod
    def of(cls, sources: Sequence, fingerprint: FingerprintMode, geometry) -> LayoutSignature:
        """The signature of a canary over ``sources`` (KVSource, in order) with ``fingerprint``
        and the layout fields of ``geometry`` (a PoolGeometry); the page size is the geometry's,
        else the sources' (None without either)."""
        page = geometry.page_size if geometry.page_size is not None else (sources[0].page_size if sources else None)
        return cls(RECORD_VERSION, tuple(s.layer for s in sources), tuple(Half(s.half) for s in sources), page,
                   dtype_name(geometry.kv_dtype), geometry.num_kv_heads, geometry.head_dim,
                   FingerprintMode(fingerprint), geometry.model)

    def differences(self, sender: LayoutSignature, names: Sequence[str] | None = None) -> list[str]:
        """One ``"<field> sender <value> receiver <value>"`` per field (of ``names``; None: every
        field) where ``sender`` differs."""
        names = [f.name for f in fields(self)] if names is None else names
        return [f"{n} sender {_show(getattr(sender, n))} receiver {_show(getattr(self, n))}"
                for n in names if getattr(sender, n) != getattr(self, n)]

    def check(self, op: str, sender: object, names: Sequence[str] | None = None) -> None:
        """Raise KVCanaryError unless ``sender`` (the signature the rows came with) equals this
        receiver's (in the fields ``names``; None: every field); the error names every differing
        field with both sides' values."""
        if sender is self:
            return
        if not isinstance(sender, LayoutSignature):
            raise KVCanaryError(f"{op} signature must be the sender's LayoutSignature (its canary.signature, shipped "
                                f"with the rows), got {type(sender).__name__}")
        if names is None and sender == self:
            return
        diffs = self.differences(sender, names)
        if diffs:
            raise KVCanaryError(f"{op}: signature mismatch: {'; '.join(diffs)} (the rows were written for another "
                                f"layout; build both sides with the same layers, halves, real_kv and PoolGeometry)")


def _show(value: object) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(_show(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, (Half, FingerprintMode)):
        return value.name
    return repr(value) if isinstance(value, str) else str(value)
