"""The launcher of ``check_forward``'s kernel (``ops.check_kernel``): its grid (one ticket for
the write offsets, ``bs * split`` verifiers, one writer per block of written tokens), its fixed
leading arguments keyed once, and its compile-time variants."""

from __future__ import annotations

import torch

from kvcanary.core.record import record_words
from kvcanary.errors import InputError
from kvcanary.ops._common import cdiv, num_bits, triton
from kvcanary.ops.check_kernel import _check_kernel
from kvcanary.ops.fingerprint import FingerprintMode, block_words, source_halves, source_words
from kvcanary.ops.launcher import Fixed, launch_typed
from kvcanary.ops.state import COUNTER_BLOCK_WORDS, WRITE_BLOCK, DeviceState, Workspace

RECORD_BLOCK = 128
MAX_SPLIT = 1024  # programs per request verifying its prefix
TARGET_PROGRAMS = 1024
# HEAD's programs verify, mark the prefix slots they read and stamp: with 8 warps a decode HEAD
# took 21-31 % less time on an H200 at bs 1 and bs 256 (the same at bs 64); TAIL keeps 4
HEAD_WARPS = 8


def held_arg(held: torch.Tensor | None, counted: bool = False) -> int:
    """The kernel's ``n_held`` for ``held`` (slots), or for ``held_words`` where ``counted``: minus its length."""
    if held is None:
        return 0
    return -held.shape[0] if counted else held.shape[0]


def verify_split(bs: int, max_ctx: int, block: int) -> int:
    """Programs per request: enough to fill ~TARGET_PROGRAMS programs, no more than a full row needs."""
    return max(1, min(cdiv(max_ctx, block), cdiv(TARGET_PROGRAMS, max(bs, 1))))


def check_split(split, max_spins) -> None:
    if split is not None and (isinstance(split, bool) or not isinstance(split, int) or not 1 <= split <= MAX_SPLIT):
        raise InputError(f"split {split!r} out of range [1, {MAX_SPLIT}]; pass None (verify_split) or a positive int")
    if max_spins is not None and (isinstance(max_spins, bool) or not isinstance(max_spins, int)
                                  or not 1 <= max_spins < 2**62):
        raise InputError(f"max_spins {max_spins!r} out of range [1, 2**62); pass None for the default")


class CheckLaunch:
    """The Triton launch of ``check_forward`` on arguments it has validated: everything but the
    batch, the tag and the held slots fixed at construction (``BoundCheck`` keeps one)."""

    def __init__(self, state: DeviceState, workspace: Workspace, stamp: bool, sources: list, mode: FingerprintMode,
                 meta, marks, window: int, split: int | None, max_spins: int | None, publication: tuple | None = None):
        ws = workspace
        self.publication = publication  # (seq, rows), validated: a launch may publish the counter block
        fp_sources = [] if stamp else sources  # HEAD verifies no fingerprint; it marks the write targets
        # TAIL without fingerprints: 256 a verify program (16-20 % faster than 512 at large decode shapes)
        self.block_v = {FingerprintMode.NONE: 1024, FingerprintMode.PARTIAL: 256, FingerprintMode.ALL: 32}[mode] \
            if fp_sources else 512 if stamp else 256
        self.cuda = state.device.type == "cuda"
        self.split, self.num_warps = split, HEAD_WARPS if stamp else 4
        self.sync = ws.sync
        self.block_t = WRITE_BLOCK if stamp else RECORD_BLOCK  # HEAD: 256 tokens a program; TAIL: 128 fingerprints
        self.writers = stamp or bool(sources)
        self.seed = ws.seed
        max_spins = max_spins if max_spins is not None else 1 << 24 if self.cuda else 64
        # the kernel's leading arguments, the same at every launch: keyed once (ops.launcher.Fixed)
        self.fixed = Fixed(_check_kernel, (
            record_words(state.records), state.ring, state.ring_counter, state.stats, state.error, ws.sync,
            ws.write_offsets, ws.seed, ws.block_sum, ws.block_flag, marks.words if stamp else ws.sync,
            marks.epoch if stamp else ws.sync, *source_words(sources, ws.seed), meta if meta is not None else ws.sync,
            state.source_tags, source_halves(fp_sources), window, state.num_slots, state.ring_capacity, max_spins,
            *(publication if publication is not None else (ws.sync, ws.sync)),
            publication[1].shape[0] if publication is not None else 1))
        self.constexprs = dict(
            STAMP=stamp, HAS_LUT=False, HAS_TRUTH=False, NUM_SOURCES=len(sources), VERIFY_SOURCES=len(fp_sources),
            HALVES=source_halves(sources),
            NBITS=num_bits(ws.max_bs),  # the workspace's capacity, not bs: one variant for every batch size
            BLOCK_V=self.block_v, BLOCK_W=block_words(fp_sources, mode) if fp_sources else 4, BLOCK_T=self.block_t,
            PUBLISH=False, PUB_W=COUNTER_BLOCK_WORDS, PUB_BLOCK=triton.next_power_of_2(COUNTER_BLOCK_WORDS),
            FENCE=self.cuda, SCATTER=False, HAS_STARTS=False)
        self._variants: dict = {}  # a launch's variant -> its constexprs (``_constexprs``)
        self._splits: dict = {}  # (bs, max_ctx) -> ``verify_split``'s programs a request

    def launch(self, rpi, prefix_lens, extend_lens, rtt, ids, pos, loc, truth, truth_lens, lut, held, tag,
               publish: bool = False, truth_ids=None, truth_offsets=None, truth_starts=None,
               counted: bool = False) -> None:
        """``counted``: ``held`` is ``check_forward``'s ``held_words``."""
        rows, max_ctx = rtt.shape
        self.launch_laid(self.tensors(rpi, prefix_lens, extend_lens, rtt, ids, pos, loc, truth, truth_lens, lut, held,
                                      truth_ids, truth_offsets, truth_starts),
                         lut is not None, truth is not None, held_arg(held, counted), tag,
                         (ids.shape[0], rpi.shape[0], rows, max_ctx, rtt.stride(0), lut.shape[0] if lut is not None
                          else 0), publish=publish, n_tids=truth_ids.shape[0] if truth_ids is not None else -1,
                         starts=truth_starts is not None)

    def launch_laid(self, tensors: tuple, has_lut: bool, has_truth: bool, held: int, tag: int, laid: tuple,
                    addresses: list | None = None, publish: bool = False, n_tids: int = -1,
                    starts: bool = False) -> None:
        """``launch`` of ``tensors`` (``tensors()``) with the batch's sizes read already: ``held`` is
        the kernel's ``n_held`` (``_held_arg``); ``laid`` is
        (n, bs, rows, max_ctx, rtt.stride(0), len(lut) or 0); ``addresses``: the tensors'
        ``data_ptr()``, where the caller read them; ``publish``: the last program out publishes
        the counter block (``publication``, bound); ``n_tids`` >= 0: HEAD scatters the truth
        ``tensors()`` holds (that many tokens) into the truth table first, as appends from the
        start columns it holds where ``starts``, else as whole histories."""
        # memo lookups and arithmetic written out, not calls: between a model's launches each Python
        # call costs µs
        n, bs = laid[0], laid[1]
        split = self.split
        if split is None:
            split = self._splits.get((bs, laid[3]))
            if split is None:
                split = self._splits[bs, laid[3]] = verify_split(bs, laid[3], self.block_v) if self.cuda else 1
        n_verify = bs * split
        grid = 1 + n_verify + (-(-n // self.block_t) if self.writers else 0)  # cdiv
        truth_t = tensors[5]  # the truth table, or the page table in its place
        scatter = n_tids >= 0
        variant = (has_lut, has_truth, held != 0, publish, scatter, starts)
        constexprs = self._variants.get(variant)
        if constexprs is None:
            constexprs = self._constexprs(has_lut, has_truth, publish, scatter, starts)
        launch_typed(_check_kernel, (grid,), tensors,
                     (*laid, truth_t.stride(0), truth_t.shape[1], tag, split, n_verify, grid,
                      held, n_tids if scatter else 0),
                     variant, constexprs, num_warps=self.num_warps, fixed=self.fixed, addresses=addresses)

    def tensors(self, rpi, prefix_lens, extend_lens, rtt, ids, pos, loc, truth, truth_lens, lut, held,
                truth_ids=None, truth_offsets=None, truth_starts=None) -> tuple:
        """The kernel's fourteen per-launch tensors, in its order (an absent one's place taken by a
        tensor of the same dtype the kernel does not read)."""
        return (rpi, prefix_lens, extend_lens, rtt, lut if lut is not None else self.seed,
                truth if truth is not None else rtt, truth_lens if truth_lens is not None else prefix_lens,
                ids, pos, loc, held if held is not None else self.sync,
                truth_ids if truth_ids is not None else prefix_lens,
                truth_offsets if truth_offsets is not None else prefix_lens,
                truth_starts if truth_starts is not None else prefix_lens)

    def _constexprs(self, has_lut: bool, has_truth: bool, publish: bool = False, scatter: bool = False,
                    starts: bool = False) -> dict:
        """The constexprs of a launch with these flags, kept in ``_variants`` under the launch's variant
        (the flags and whether slots are held, which changes no constexpr: both keys share one dict)."""
        c = {**self.constexprs, "HAS_LUT": has_lut, "HAS_TRUTH": has_truth, "PUBLISH": publish, "SCATTER": scatter,
             "HAS_STARTS": starts}
        for held in (False, True):
            c = self._variants.setdefault((has_lut, has_truth, held, publish, scatter, starts), c)
        return c
