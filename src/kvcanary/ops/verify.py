"""verify: check every entry of a verify plan against the canary records.

Entry e (slot, pred, position, token) with stored record (tok, pos, chain, fp) of ``slot``:

| check        | fails when                                                                 |
|--------------|----------------------------------------------------------------------------|
| CHAIN        | pred valid: chain != chain[pred] + link(token[pred], position[pred]);      |
|              | pred = -1 and position = 0: chain != ANCHOR (pred = -1 otherwise: skipped) |
| POSITION     | pos != position                                                            |
| VERIFY_TOKEN | token != -1 and tok != token                                               |
| FINGERPRINT  | sources given: fp != fingerprint of the slot's K/V bytes                   |

A FINGERPRINT row's tag column names the sources whose part differs from the slot's side word
(``fingerprint.mismatch_tag``); every other row carries ``tag`` as given.

Slot 0 is skipped. A slot < 0 or >= num_slots (an unresolvable page-table entry: the plan's -1
for the padding slot or an unmapped window slot, a negative or out-of-pool slot) is reported as
BAD_ENTRY only: slot = the plan's ``entry``, stored position = the position, stored token = -1,
stored value = the plan's ``row``, expected value = the resolved slot (see core.record). A
predecessor outside (0, num_slots) counts as -1. Entries
e < min(max(count, 0), cap) are checked when ``enable`` is non-zero; ``stats[tag]`` gets one launch and the
number of slots checked. Rows go to the ring (order unspecified); the stored/expected value
pair belongs to the first failing check in the order of the table.
"""

from __future__ import annotations

import torch

from kvcanary.core.hashing import ANCHOR_S, link_torch
from kvcanary.core.record import (
    CHAIN,
    FINGERPRINT,
    POSITION,
    STAT_CHECKED,
    STAT_LAUNCHES,
    TOKEN,
    Reason,
    record_words,
)
from kvcanary.ops import _cpu
from kvcanary.ops._common import Backend, cdiv, check_programs, tl, triton, use_triton
from kvcanary.ops._cpu import use_numba
from kvcanary.ops._jit import append_violations, link64
from kvcanary.ops._ring import append_violations_torch, validate_ring
from kvcanary.ops.fingerprint import (
    FingerprintMode,
    block_words,
    fingerprint_torch,
    fold_sources,
    mismatch_tag,
    mismatch_tag_torch,
    source_halves,
    source_words,
)
from kvcanary.ops.launcher import Fixed, launch
from kvcanary.ops.plan import Plan, validate_plan_buffers
from kvcanary.ops.sources import SourceSet
from kvcanary.ops.state import DeviceState

R_CHAIN, R_POSITION, R_FINGERPRINT, R_TOKEN = (int(Reason.CHAIN), int(Reason.POSITION), int(Reason.FINGERPRINT),
                                               int(Reason.VERIFY_TOKEN))
R_BAD_ENTRY = int(Reason.BAD_ENTRY)


def validate_verify(state, plan, tag, sources, mode, meta=None) -> tuple[int, SourceSet]:
    """``verify``'s checks: (the tag, the sources as a ``SourceSet``)."""
    tag = validate_ring(state, tag)
    validate_plan_buffers(plan, state.device)
    return tag, SourceSet.resolve(sources, mode, meta, state.num_slots, state.device)


def _verify_torch(state, plan, tag, sources, mode):
    canary, ring, counter, stats = state.records, state.ring, state.ring_counter, state.stats
    num_slots = canary.shape[0]
    stats[tag, STAT_LAUNCHES] += 1
    m = min(max(int(plan.count[0]), 0), plan.capacity) if int(plan.enable[0]) != 0 else 0
    if m == 0:
        return
    words = record_words(canary)
    slot = plan.slot[:m].to(torch.int64)
    pred = plan.pred[:m].to(torch.int64)
    epos = plan.position[:m].to(torch.int64)
    etok = plan.token[:m].to(torch.int64)
    live = slot != 0
    inside = (slot > 0) & (slot < num_slots)
    wild = live & ~inside
    rec = words[torch.where(inside, slot, torch.zeros_like(slot))]
    minus1 = torch.full_like(slot, -1)
    tok = torch.where(inside, rec[:, TOKEN], minus1)
    pos = torch.where(inside, rec[:, POSITION], minus1)
    chain = torch.where(inside, rec[:, CHAIN], minus1)
    pred_ok = (pred > 0) & (pred < num_slots)
    prec = words[torch.where(pred_ok, pred, torch.zeros_like(pred))]
    exp_chain = torch.where(pred_ok, prec[:, CHAIN] + link_torch(prec[:, TOKEN], prec[:, POSITION]),
                            torch.full_like(slot, ANCHOR_S))
    check_chain = pred_ok | (epos == 0)
    chain_bad = inside & check_chain & (chain != exp_chain)
    pos_bad = inside & (pos != epos)
    tok_bad = inside & (etok != -1) & (tok != etok)
    fp_bad = torch.zeros_like(inside)
    stored_fp = exp_fp = torch.zeros_like(slot)
    row_tag = torch.full_like(slot, tag)
    if sources:
        safe = torch.where(inside, slot, torch.ones_like(slot))
        exp_fp, exp_tags = fingerprint_torch(safe, sources, mode)
        stored_fp = rec[:, FINGERPRINT]
        fp_bad = inside & (stored_fp != exp_fp)
        row_tag = mismatch_tag_torch(tag, fp_bad, state.source_tags[safe], exp_tags, sources)
    reasons = (chain_bad.to(torch.int64) * R_CHAIN + pos_bad.to(torch.int64) * R_POSITION
               + fp_bad.to(torch.int64) * R_FINGERPRINT + tok_bad.to(torch.int64) * R_TOKEN
               + wild.to(torch.int64) * R_BAD_ENTRY)
    stored = torch.where(chain_bad, chain, torch.where(pos_bad, pos, torch.where(fp_bad, stored_fp, tok)))
    want = torch.where(chain_bad, exp_chain, torch.where(pos_bad, epos, torch.where(fp_bad, exp_fp, etok)))
    entry = plan.entry[:m].to(torch.int64)
    prow = plan.row[:m].to(torch.int64)
    cols = [torch.where(wild, entry, slot), torch.where(wild, epos, pos), tok, etok, torch.where(wild, prow, stored),
            torch.where(wild, slot, want), reasons]
    append_violations_torch(ring, counter, reasons != 0, row_tag, cols)
    stats[tag, STAT_CHECKED] += live.sum()


@triton.jit
def check_entries(words_ptr, tags_ptr, slot, pred, epos, etok, entry, prow, m, num_slots, ring_ptr, counter_ptr,
                  ring_cap, tag, halves, w0_ptr, w1_ptr, w2_ptr, w3_ptr, meta_ptr, NUM_SOURCES: tl.constexpr,
                  BLOCK: tl.constexpr, BLOCK_W: tl.constexpr):
    """The checks of the module doc on BLOCK entries (int64 lanes; ``m`` masks the live ones):
    violations to the ring; returns the number of entries checked (slot != 0)."""
    live = m & (slot != 0)
    inside = live & (slot > 0) & (slot < num_slots)
    wild = live & ~inside
    rec = words_ptr + tl.where(inside, slot, 0) * 4
    tok = tl.load(rec + 0, mask=inside, other=-1)
    pos = tl.load(rec + 1, mask=inside, other=-1)
    chain = tl.load(rec + 2, mask=inside, other=-1).to(tl.uint64, bitcast=True)
    pred_ok = inside & (pred > 0) & (pred < num_slots)
    prec = words_ptr + tl.where(pred_ok, pred, 0) * 4
    p_tok = tl.load(prec + 0, mask=pred_ok, other=0)
    p_pos = tl.load(prec + 1, mask=pred_ok, other=0)
    p_chain = tl.load(prec + 2, mask=pred_ok, other=0).to(tl.uint64, bitcast=True)
    exp_chain = tl.where(pred_ok, p_chain + link64(p_tok, p_pos), 0x4B5643414E415259)
    chain_bad = inside & (pred_ok | (epos == 0)) & (chain != exp_chain)
    pos_bad = inside & (pos != epos)
    tok_bad = inside & (etok != -1) & (tok != etok)
    fp_bad = tl.zeros_like(inside)
    stored_fp = tl.zeros((BLOCK,), dtype=tl.uint64)
    exp_fp = tl.zeros((BLOCK,), dtype=tl.uint64)
    row_tag = tl.zeros((BLOCK,), dtype=tl.int64) + tag
    if NUM_SOURCES > 0:
        # lanes outside ``inside`` load nothing (masked): their address is never dereferenced (and a
        # select here once broke a layout pass of the sm_90 compiler)
        exp_fp, exp_tags = fold_sources(slot, inside, w0_ptr, w1_ptr, w2_ptr, w3_ptr, meta_ptr, NUM_SOURCES, BLOCK,
                                        BLOCK_W)
        stored_fp = tl.load(rec + 3, mask=inside, other=0).to(tl.uint64, bitcast=True)
        fp_bad = inside & (stored_fp != exp_fp)
        stored_tags = tl.load(tags_ptr + tl.where(inside, slot, 0), mask=fp_bad, other=0).to(tl.uint64, bitcast=True)
        row_tag = mismatch_tag(tag, fp_bad, stored_tags, exp_tags, halves, NUM_SOURCES)
    reasons = (chain_bad.to(tl.int64) * 1 + pos_bad.to(tl.int64) * 2 + fp_bad.to(tl.int64) * 4
               + tok_bad.to(tl.int64) * 32 + wild.to(tl.int64) * 64)
    stored = tl.where(chain_bad, chain, tl.where(pos_bad, pos.to(tl.uint64, bitcast=True),
                                                 tl.where(fp_bad, stored_fp, tok.to(tl.uint64, bitcast=True))))
    want = tl.where(chain_bad, exp_chain, tl.where(pos_bad, epos.to(tl.uint64, bitcast=True),
                                                   tl.where(fp_bad, exp_fp, etok.to(tl.uint64, bitcast=True))))
    stored = tl.where(wild, prow.to(tl.uint64, bitcast=True), stored)
    want = tl.where(wild, slot.to(tl.uint64, bitcast=True), want)
    append_violations(ring_ptr, counter_ptr, ring_cap, reasons != 0, row_tag, tl.where(wild, entry, slot),
                      tl.where(wild, epos, pos), tok, etok, stored, want, reasons)
    return tl.sum(live.to(tl.int64), 0)


@triton.jit
def _verify_kernel(words_ptr, tags_ptr, slot_ptr, pred_ptr, pos_ptr, tok_ptr, entry_ptr, row_ptr, count_ptr,
                   enable_ptr, ring_ptr, counter_ptr, stats_ptr, cap, num_slots, ring_cap, halves, w0_ptr,
                   w1_ptr, w2_ptr, w3_ptr, meta_ptr, tag, NUM_SOURCES: tl.constexpr, BLOCK: tl.constexpr,
                   BLOCK_W: tl.constexpr):
    """Persistent grid: program p checks entries p*BLOCK + k*nprog*BLOCK + [0, BLOCK) below
    min(count, cap) (none when enable is 0); each lane gathers its record and its predecessor's."""
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0).to(tl.int64)
    limit = tl.minimum(tl.maximum(tl.load(count_ptr), 0), cap)
    limit = tl.where(tl.load(enable_ptr) != 0, limit, 0)
    lane = tl.arange(0, BLOCK).to(tl.int64)
    checked = tl.zeros((), dtype=tl.int64)
    for base in range(pid * BLOCK, limit, nprog * BLOCK):
        e = base + lane
        m = e < limit
        slot = tl.load(slot_ptr + e, mask=m, other=0).to(tl.int64)
        pred = tl.load(pred_ptr + e, mask=m, other=-1).to(tl.int64)
        epos = tl.load(pos_ptr + e, mask=m, other=0).to(tl.int64)
        etok = tl.load(tok_ptr + e, mask=m, other=-1).to(tl.int64)
        entry = tl.load(entry_ptr + e, mask=m, other=0).to(tl.int64)
        prow = tl.load(row_ptr + e, mask=m, other=0).to(tl.int64)
        checked += check_entries(words_ptr, tags_ptr, slot, pred, epos, etok, entry, prow, m, num_slots, ring_ptr,
                                 counter_ptr, ring_cap, tag, halves, w0_ptr, w1_ptr, w2_ptr, w3_ptr, meta_ptr,
                                 NUM_SOURCES, BLOCK, BLOCK_W)
    tl.atomic_add(stats_ptr + tag * 3 + 1, checked, mask=checked > 0)
    if pid == 0:
        tl.atomic_add(stats_ptr + tag * 3 + 0, 1)


def verify(*, state: DeviceState, plan: Plan, tag: int, sources=(), mode: FingerprintMode = FingerprintMode.NONE,
           meta: torch.Tensor | None = None, max_programs: int = 1024, backend: Backend = Backend.AUTO) -> None:
    """Check the plan's entries (see module doc) against ``state.records``; rows to ``state.ring``,
    counts to ``state.stats``. Never raises on values; raises InputTypeError / InputError (before
    anything is written) for a bad state, plan, tag, sources or ``meta``."""
    tag, kv = validate_verify(state, plan, tag, sources, mode, meta)
    sources, mode, meta, device = kv.list(), kv.mode, kv.meta, state.device
    check_programs(max_programs)
    if use_numba(backend, device):
        _cpu.verify(state, plan, tag, sources, meta)
    elif use_triton(backend, device):
        _VerifyLaunch(state, plan, sources, mode, meta, max_programs).launch(tag)
    else:
        _verify_torch(state, plan, tag, sources, mode)


class _VerifyLaunch:
    """The Triton launch of ``verify`` on arguments it has validated: all but the tag fixed."""

    def __init__(self, state: DeviceState, plan: Plan, sources: list, mode: FingerprintMode, meta, max_programs: int):
        canary, ring = state.records, state.ring
        block = {FingerprintMode.NONE: 1024, FingerprintMode.PARTIAL: 256, FingerprintMode.ALL: 32}[mode] if sources \
            else 1024
        self.grid = (max(1, min(cdiv(plan.capacity, block), max_programs)),)
        # every argument but the tag, keyed once (ops.launcher.Fixed)
        self.fixed = Fixed(_verify_kernel, (
            record_words(canary), state.source_tags, plan.slot, plan.pred, plan.position, plan.token, plan.entry,
            plan.row, plan.count, plan.enable, ring, state.ring_counter, state.stats, plan.capacity, canary.shape[0],
            ring.shape[0], source_halves(sources), *source_words(sources, plan.slot),
            meta if meta is not None else plan.count))
        self.constexprs = dict(NUM_SOURCES=len(sources), BLOCK=block,
                               BLOCK_W=block_words(sources, mode) if sources else 4)

    def launch(self, tag: int) -> None:
        launch(_verify_kernel, self.grid, (tag,), self.constexprs, num_warps=4, fixed=self.fixed)


