"""Frozen configs of the reference engine, validated on construction.

Every error is a ``ConfigError`` (a ``ValueError``) naming the field, the expected and the
actual value, and what to change.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kvcanary.errors import ConfigError


class Bug(enum.Enum):
    """Real-bug zoo switches (``kvcanary.engine.zoo`` documents each one); all off by default."""

    ABORT_INFLIGHT_WRITE = "abort_inflight_write"
    PREFIX_PAGE_OFF_BY_ONE = "prefix_page_off_by_one"
    PADDING_WRITES_LIVE_SLOT = "padding_writes_live_slot"
    OFFLOAD_SHARED_HOST_ROW = "offload_shared_host_row"
    LOAD_BACK_UNORDERED = "load_back_unordered"
    STALE_RADIX_NODE = "stale_radix_node"
    FAILED_LOAD_COUNTED = "failed_load_counted"
    REPREFILL_PROMPT_ONLY = "reprefill_prompt_only"
    REJECTED_DRAFT_KV_CACHED = "rejected_draft_kv_cached"
    PARTIAL_PAGE_HIT = "partial_page_hit"
    CHUNK_POSITIONS_RESTART = "chunk_positions_restart"


def parse_bugs(bugs: Iterable[Bug | str]) -> frozenset[Bug]:
    """``bugs`` as a frozenset of ``Bug`` (members or their string values). Raises ValueError."""
    return frozenset(Bug(b) for b in bugs)


class SamplerKind(enum.Enum):
    GREEDY = "greedy"  # argmax of the logits
    ORACLE = "oracle"  # hash of (request id, position): outputs independent of the logits


Rule = tuple[str, Callable[[], bool], str, str]  # field, check, expected, what to change


def _validate(config: object, rules: list[Rule]) -> None:
    """Apply ``rules`` in order (a later check may rely on an earlier one having passed)."""
    owner = type(config).__name__
    for name, ok, expected, fix in rules:
        if not ok():
            actual = getattr(config, name)
            raise ConfigError(f"{owner}.{name} must be {expected}, got {actual!r}; {fix}")


def _positive(config: object, *names: str) -> list[Rule]:
    def is_positive(name: str) -> bool:
        value = getattr(config, name)
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    return [
        (name, lambda name=name: is_positive(name), "an int >= 1", f"pass a positive {name}")
        for name in names
    ]


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclass(frozen=True)
class ModelConfig:
    """Shape and seed of the tiny Llama-style model. Weights are drawn from ``seed``.

    ``window_layers``: layers that attend over a sliding window of the last ``sliding_window``
    positions (query t sees keys ``t - sliding_window < j <= t``) and keep their K/V in the
    engine's smaller window pool; () = every layer attends over the whole prefix.
    """

    vocab_size: int = 256
    hidden: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    rope_theta: float = 10000.0
    dtype: torch.dtype = torch.float64
    seed: int = 0
    sliding_window: int = 0
    window_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        names = (
            "vocab_size",
            "hidden",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate",
        )
        _validate(self, _positive(self, *names) + [
            ("num_heads", lambda: self.num_heads % self.num_kv_heads == 0,
             f"a multiple of num_kv_heads ({self.num_kv_heads})",
             "each KV head serves num_heads // num_kv_heads query heads"),
            ("head_dim", lambda: self.head_dim % 2 == 0, "even", "RoPE rotates pairs of dimensions"),
            ("rope_theta", lambda: isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0,
             "a number > 0", "use e.g. 10000.0"),
            ("dtype", lambda: isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point,
             "a floating torch.dtype", "use torch.float64 (batch-invariant) or another float type"),
            ("seed", lambda: isinstance(self.seed, int) and 0 <= self.seed < 2**63,
             "an int in [0, 2**63)", "pass a non-negative seed"),
            ("window_layers", lambda: isinstance(self.window_layers, tuple) and all(
                type(x) is int for x in self.window_layers) and list(self.window_layers) == sorted(
                set(self.window_layers)) and all(0 <= x < self.num_layers for x in self.window_layers),
             f"a tuple of distinct layer indices in [0, {self.num_layers}) in increasing order",
             "pass e.g. (0, 2), or () for full attention everywhere"),
            ("window_layers", lambda: len(self.window_layers) < self.num_layers, "not every layer",
             "keep at least one full-attention layer: the window pool is addressed through the full pool"),
            ("sliding_window", lambda: type(self.sliding_window) is int and (
                self.sliding_window >= 1 if self.window_layers else self.sliding_window == 0),
             ">= 1 with window_layers, 0 without", "pass both sliding_window and window_layers, or neither"),
        ])  # fmt: skip

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Layers that attend over the whole prefix (their K/V lives in the full pool)."""
        return tuple(x for x in range(self.num_layers) if x not in self.window_layers)


@dataclass(frozen=True)
class EngineConfig:
    """Capacities and policies of the engine.

    Slots are handed out by pages of ``page_size``; page 0 (slots ``0..page_size-1``) is
    reserved for padding writes, and page-table row 0 is reserved for padding requests.
    ``host_tier_slots`` is the number of host rows (one slot's K/V each); 0 disables offload.
    ``sampler`` also accepts its string value; ``device`` any CPU or CUDA device string.
    ``graph_batch_sizes``: decode-only batches are padded to the smallest of these sizes that fits
    (as CUDA-graph replay does) with padding requests (row 0, writing slot 0); () = no padding.
    ``num_draft_tokens``: speculative decoding, drafts per decode step verified against the oracle
    sampler (0 = off). ``window_slots``: slots of the window pool of a model with sliding-window
    layers (slot 0 reserved; 0 = sized by the pool, see ``kvcanary.engine.pool.window_pool_slots``).
    ``cuda_graph``: capture decode steps (canary HEAD + model + canary TAIL) in CUDA graphs, one
    per size of ``graph_batch_sizes``, and replay them (``kvcanary.engine.cuda_graph``).
    ``truth_appends``: every batch hands its token truth as appends (``ForwardBatch.truth_starts``):
    each request's history from what its row's truth holds on, one new token a request for a
    decode batch, the whole history for a row new to the request; False: every request's whole
    history at every step. None (default): on (on CUDA a graph captures a decode batch's appends
    and an eager HEAD takes them into its launch; on the CPU HEAD's compiled call makes them).
    ``jitter_ns``: spin-waits of up to this many ns at four fixed points of every forward, drawn
    per step from ``jitter_seed`` (GPU only: ``kvcanary.runtime.jitter``); 0 = off.
    ``bugs``: real-bug zoo switches (``kvcanary.engine.zoo.Bug`` or their
    string values), all off by default; the engine is correct only without them.
    """

    num_slots: int = 2048
    page_size: int = 1
    max_rows: int = 65
    max_ctx: int = 512
    chunk_size: int = 128
    max_tokens_per_step: int = 512
    max_running: int = 32
    enable_prefix_cache: bool = True
    host_tier_slots: int = 0
    sampler: SamplerKind = SamplerKind.GREEDY
    device: str = "cpu"
    graph_batch_sizes: tuple[int, ...] = ()
    num_draft_tokens: int = 0
    window_slots: int = 0
    cuda_graph: bool = False
    truth_appends: bool | None = None
    jitter_ns: int = 0
    jitter_seed: int = 0
    bugs: frozenset[Bug] = frozenset()

    def __post_init__(self) -> None:
        names = (
            "num_slots",
            "page_size",
            "max_rows",
            "max_ctx",
            "chunk_size",
            "max_tokens_per_step",
            "max_running",
        )
        _validate(self, _positive(self, *names))  # the rules below rely on these
        ps, kinds = self.page_size, [k.value for k in SamplerKind]
        _validate(self, [
            ("num_slots", lambda: self.num_slots % ps == 0, f"a multiple of page_size ({ps})",
             f"round it up to {_round_up(self.num_slots, ps)}"),
            ("num_slots", lambda: self.num_slots >= 2 * ps, f">= 2 * page_size ({2 * ps})",
             "page 0 is reserved for padding, so the pool needs at least one more page"),
            ("max_rows", lambda: self.max_rows >= 2, ">= 2", "row 0 of the page table is reserved"),
            ("max_ctx", lambda: self.max_ctx % ps == 0, f"a multiple of page_size ({ps})",
             f"round it up to {_round_up(self.max_ctx, ps)}"),
            ("max_running", lambda: self.max_running < self.max_rows, f"< max_rows ({self.max_rows})",
             "raise max_rows or lower max_running: each running request holds one page-table row"),
            ("enable_prefix_cache", lambda: isinstance(self.enable_prefix_cache, bool), "a bool",
             "pass True or False"),
            ("host_tier_slots", lambda: isinstance(self.host_tier_slots, int) and self.host_tier_slots >= 0,
             "an int >= 0", "pass 0 to disable the host tier"),
            ("host_tier_slots", lambda: self.host_tier_slots == 0 or self.enable_prefix_cache,
             "0 when enable_prefix_cache is False",
             "the host tier holds evicted prefix-cache nodes; enable the prefix cache or pass 0"),
            ("sampler", lambda: isinstance(self.sampler, SamplerKind) or self.sampler in kinds,
             f"a SamplerKind or one of {kinds}", "pass SamplerKind.GREEDY or SamplerKind.ORACLE"),
            ("device", lambda: _device_type(self.device) in ("cpu", "cuda"),
             "'cpu' or a CUDA device such as 'cuda' or 'cuda:1'", "pass a torch device string"),
            ("graph_batch_sizes", lambda: isinstance(self.graph_batch_sizes, tuple) and all(
                type(b) is int and b >= 1 for b in self.graph_batch_sizes) and list(self.graph_batch_sizes) == sorted(
                set(self.graph_batch_sizes)), "a tuple of distinct ints >= 1 in increasing order",
             "pass e.g. (1, 2, 4, 8, 16, 32), or () for no padding"),
            ("num_draft_tokens", lambda: type(self.num_draft_tokens) is int and self.num_draft_tokens >= 0,
             "an int >= 0", "pass 0 to disable speculative decoding"),
            ("num_draft_tokens", lambda: self.num_draft_tokens == 0 or SamplerKind(self.sampler) is SamplerKind.ORACLE,
             "0 with the greedy sampler", "drafts are verified against the oracle sampler; pass sampler='oracle'"),
            ("window_slots", lambda: type(self.window_slots) is int and (self.window_slots == 0 or
                                                                        self.window_slots >= 2),
             "0 (sized by the pool) or an int >= 2", "slot 0 of the window pool is reserved; pass 0 or >= 2"),
            ("cuda_graph", lambda: not self.cuda_graph or (_device_type(self.device) == "cuda"
                                                           and bool(self.graph_batch_sizes)),
             "False unless device is CUDA and graph_batch_sizes is non-empty",
             "decode steps are captured per padded batch size; pass device='cuda' and graph_batch_sizes"),
            ("truth_appends", lambda: self.truth_appends is None or isinstance(self.truth_appends, bool),
             "None (on) or a bool", "pass True, False or None"),
            ("jitter_ns", lambda: type(self.jitter_ns) is int and self.jitter_ns >= 0, "an int >= 0",
             "pass 0 to disable the timing jitter"),
            ("bugs", lambda: _is_bug_set(self.bugs),
             f"a set of kvcanary.engine.zoo.Bug (or of {[b.value for b in Bug]})",
             "pass e.g. frozenset({Bug.STALE_RADIX_NODE}), or frozenset() for the correct engine"),
        ])  # fmt: skip
        object.__setattr__(self, "sampler", SamplerKind(self.sampler))
        object.__setattr__(self, "device", str(torch.device(self.device)))
        object.__setattr__(self, "bugs", parse_bugs(self.bugs))

    @property
    def appends_truth(self) -> bool:
        """Whether decode batches hand their token truth as appends (``truth_appends``)."""
        return True if self.truth_appends is None else self.truth_appends

    @property
    def num_pages(self) -> int:
        return self.num_slots // self.page_size

    @property
    def num_usable_slots(self) -> int:
        """Slots the allocator can hand out: all but page 0."""
        return self.num_slots - self.page_size


def _is_bug_set(bugs: object) -> bool:
    if isinstance(bugs, (str, bytes)) or not isinstance(bugs, (set, frozenset, tuple, list)):
        return False
    try:
        parse_bugs(bugs)
    except ValueError:
        return False
    return True


def _device_type(device: object) -> str | None:
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError):
        return None
