"""Prefill/decode split: one engine prefills, a second receives the K/V and decodes.

A request runs on the prefill engine for its prompt and first token (``max_new_tokens=1``);
when it finishes there, its prompt's K/V sits in the prefill engine's prefix cache.
``KVTransfer.send`` copies it out, every layer, with its canary records (``index_select`` ->
host memory, pinned on CUDA), and ``KVTransfer.receive`` copies both into slots the decode
engine allocates (``index_copy_``; the records are content-only, so they stay valid in any
slot), verifies the landed slots at once (SWEEP) and caches them in the decode engine's prefix
cache, where the request (prompt + first token) finds them when admitted; its first forward's
HEAD verifies every received slot again. The two pools never share a tensor. The records travel
with the prefill canary's layout signature; ``receive`` refuses a payload whose signature differs
from the decode canary's (KVCanaryError naming both sides' values) before it allocates or writes
anything.

``TransferHooks`` are the transfer's instrumentation points (fault injectors use them):

| hook                     | when                                                            |
|--------------------------|-----------------------------------------------------------------|
| ``before_send(slots)``   | before the prefill-side slots are read (after their last check) |
| ``after_send(payload)``  | the payload is in host memory, not yet written anywhere         |
| ``destination(p, dst)``  | returns the slots the copy writes (``dst``: the decode engine's) |
| ``after_receive(p, dst)``| the copy landed in ``dst`` and was verified                     |
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcanary.engine.engine import Engine
from kvcanary.runtime.canary import Canary, LayoutSignature


@dataclass
class TransferPayload:
    """One request's prompt K/V in flight: ``k``/``v`` [num_layers, n, num_kv_heads, head_dim]
    and ``records`` uint8[n, 40] (``Canary.export_rows``: each record and its side word) in host
    memory, for positions ``0..n-1`` of ``token_ids``; ``signature``: the prefill canary's
    (what the records mean), None without ``records``."""

    request_id: int
    token_ids: list[int]
    src_slots: torch.Tensor  # int64[n], the prefill engine's
    k: torch.Tensor
    v: torch.Tensor
    records: torch.Tensor | None
    signature: LayoutSignature | None = None

    @property
    def num_bytes(self) -> int:
        rec = self.records.numel() if self.records is not None else 0
        return self.k.numel() * self.k.element_size() * 2 + rec


class TransferHooks:
    """No-op transfer hooks; see the module docstring for when each runs."""

    def before_send(self, slots: torch.Tensor) -> None:
        pass

    def after_send(self, payload: TransferPayload) -> None:
        pass

    def destination(self, payload: TransferPayload, dst: torch.Tensor) -> torch.Tensor:
        return dst

    def after_receive(self, payload: TransferPayload, dst: torch.Tensor) -> None:
        pass


@dataclass
class TransferStats:
    requests: int = 0
    slots: int = 0
    bytes: int = 0
    dropped: int = 0  # payloads the decode engine had no room for (the request recomputes)
    duplicate_slots: int = 0  # received slots whose tokens the decode engine had cached already


class KVTransfer:
    """Copies prompts' K/V and canary records from ``prefill`` to ``decode`` (both with a
    prefix cache; the canaries may be None when the canary is off)."""

    def __init__(self, prefill: Engine, decode: Engine, prefill_canary: Canary | None, decode_canary: Canary | None,
                 hooks: Sequence[TransferHooks] = ()):
        if prefill.tree is None or decode.tree is None:
            raise ValueError("KVTransfer needs both engines built with EngineConfig.enable_prefix_cache=True")
        if prefill.pool.window is not None or decode.pool.window is not None:
            raise ValueError("KVTransfer moves full-attention pools only; use a model without window_layers")
        self.prefill, self.decode = prefill, decode
        self.prefill_canary, self.decode_canary = prefill_canary, decode_canary
        self.hooks = list(hooks)
        self.stats = TransferStats()

    def send(self, request_id: int, token_ids: Sequence[int]) -> TransferPayload | None:
        """Read the K/V and records of ``token_ids`` (whole pages) from the prefill engine's prefix
        cache into host memory; None when they are not all on its device."""
        tree = self.prefill.tree
        node, length = tree.match(list(token_ids))
        if length != len(token_ids) or any(n.is_on_host for n in node.path()):
            return None
        slots = torch.cat([n.slots for n in node.path()]).to(self.prefill.device)
        for h in self.hooks:
            h.before_send(slots)
        pool, pin = self.prefill.pool, self.prefill.device.type == "cuda"
        k = torch.stack([buf.index_select(0, slots) for buf in pool.k_buffers]).to("cpu")
        v = torch.stack([buf.index_select(0, slots) for buf in pool.v_buffers]).to("cpu")
        records = self.prefill_canary.export_rows(slots).cpu() if self.prefill_canary is not None else None
        if pin:
            k, v = k.pin_memory(), v.pin_memory()
            records = records.pin_memory() if records is not None else None
        signature = self.prefill_canary.signature if self.prefill_canary is not None else None
        payload = TransferPayload(request_id, list(token_ids), slots.cpu(), k, v, records, signature)
        for h in self.hooks:
            h.after_send(payload)
        return payload

    def receive(self, payload: TransferPayload) -> torch.Tensor | None:
        """Copy ``payload`` into fresh decode-engine slots (their records verified at once) and
        cache them in its prefix cache. Returns the slots, or None when there was no room. Raises
        KVCanaryError for records whose signature differs from the decode canary's, before
        anything is allocated or written."""
        decode, n = self.decode, len(payload.token_ids)
        if self.decode_canary is not None and payload.records is not None:
            self.decode_canary.signature.check("KVTransfer.receive", payload.signature)
        dst = decode.cache.alloc_slots(n)
        if dst is None:
            self.stats.dropped += 1
            return None
        write = dst
        for h in self.hooks:
            write = h.destination(payload, write)
        dev = decode.device
        index = write.to(dev)
        for layer, (k_buf, v_buf) in enumerate(zip(decode.pool.k_buffers, decode.pool.v_buffers, strict=True)):
            k_buf.index_copy_(0, index, payload.k[layer].to(dev, non_blocking=True))
            v_buf.index_copy_(0, index, payload.v[layer].to(dev, non_blocking=True))
        if self.decode_canary is not None and payload.records is not None:
            self.decode_canary.land_rows(index, payload.records, payload.signature)
            self.decode_canary.verify_landed(dst.to(dev))  # in page-table order: a misplaced row is caught
        inserted = decode.tree.insert(payload.token_ids, dst)
        if decode.host_tier is not None:
            decode.host_tier.free_rows(inserted.revived_host_rows)
        decode.pool.free(inserted.duplicate_slots)
        self.stats.requests += 1
        self.stats.slots += n
        self.stats.bytes += payload.num_bytes
        self.stats.duplicate_slots += inserted.duplicate_slots.numel()
        for h in self.hooks:
            h.after_receive(payload, dst)
        return dst
