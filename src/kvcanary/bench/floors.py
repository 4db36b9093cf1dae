"""The step an overhead figure is put against: model and step shapes, and the bytes a step must move.

The bandwidth floor of a step is the time its unavoidable memory traffic takes at the copy
bandwidth measured in the same run: the weights read once, the K/V the attention reads over all
layers, and the K/V the step writes (activations and compute ignored, so the floor is a lower
bound on any real step and the overhead figure is conservative).

| bytes       | formula                                                            |
|-------------|--------------------------------------------------------------------|
| row         | kv_heads * head_dim * dtype_bytes (one half of one layer, 1 token) |
| per token   | num_layers * 2 (K and V) * row                                     |
| weights     | weight_bytes                                                       |
| KV read     | bs * context * per token (the prefix each request attends to)      |
| KV written  | bs * extend * per token                                            |
| floor (µs)  | (weights + KV read + KV written) / copy GB/s / 1e3                 |

A prefill of ``n`` tokens has ``context = 0, extend = n``; a decode step ``extend = 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcanary.bench.timing import floor_us


@dataclass(frozen=True)
class ModelShape:
    """The protected model: its K/V geometry and weight bytes (8B-shaped by default)."""

    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    weight_bytes: int = 16 * 10**9

    @property
    def row_bytes(self) -> int:
        return self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.row_bytes


@dataclass(frozen=True)
class StepShape:
    """``bs`` requests, each reading ``context`` cached tokens and writing ``extend`` new ones."""

    kind: str  # "decode" or "prefill"
    bs: int
    context: int
    extend: int

    def __post_init__(self):
        if self.kind not in ("decode", "prefill"):
            raise ValueError(f"StepShape.kind must be 'decode' or 'prefill', got {self.kind!r}")
        if self.bs < 1 or self.context < 0 or self.extend < 1:
            raise ValueError(f"StepShape needs bs >= 1, context >= 0, extend >= 1; got bs={self.bs}, "
                             f"context={self.context}, extend={self.extend}")

    @classmethod
    def decode(cls, bs: int, context: int) -> StepShape:
        return cls("decode", bs, context, 1)

    @classmethod
    def prefill(cls, tokens: int, bs: int) -> StepShape:
        return cls("prefill", bs, 0, tokens)

    @property
    def label(self) -> str:
        if self.kind == "decode":
            return f"decode bs {self.bs} @ {self.context}"
        return f"prefill {self.extend} × bs {self.bs}"

    @property
    def slots(self) -> int:
        """Slots the step's requests hold (read and written)."""
        return self.bs * (self.context + self.extend)

    def bytes(self, model: ModelShape) -> dict[str, int]:
        """The step's unavoidable memory traffic by kind, and the total."""
        read = self.bs * self.context * model.kv_bytes_per_token
        written = self.bs * self.extend * model.kv_bytes_per_token
        return {"weights": model.weight_bytes, "kv_read": read, "kv_written": written,
                "total": model.weight_bytes + read + written}

    def floor_us(self, model: ModelShape, copy_GBps: float) -> float:
        return floor_us(self.bytes(model)["total"], copy_GBps)


MODEL_8B = ModelShape()
STUDY_SHAPES = tuple([StepShape.decode(bs, ctx) for bs in (1, 64, 256) for ctx in (512, 4096, 32768)]
                     + [StepShape.prefill(16384, 1), StepShape.prefill(16384, 32)])
CPU_SHAPES = (StepShape.decode(1, 512), StepShape.decode(1, 4096), StepShape.decode(64, 512),
              StepShape.decode(64, 4096), StepShape.prefill(16384, 1))
QUICK_SHAPES = (StepShape.decode(2, 64), StepShape.prefill(128, 2))

# The one comparable checker's published end-to-end overhead on an H200, in % of step time.
REFERENCE_PCT = {("decode", 1): 2.10, ("decode", 64): 0.52, ("prefill", 1): 2.17}
REFERENCE_NOTE = ("the one comparable checker's published end-to-end overhead on an H200: decode bs 64 0.52 %, "
                  "bs 1 2.10 %, 16k-token prefill 2.17 %")


def reference_pct(shape: StepShape) -> float | None:
    """The comparable checker's published figure for this kind of step (prefill: 16k tokens, bs 1)."""
    if shape.kind == "prefill" and shape.extend != 16384:
        return None
    return REFERENCE_PCT.get((shape.kind, shape.bs))
