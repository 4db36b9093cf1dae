"""Pure-Python oracles of the canary ops, written from the ops' module docstrings.

Plain lists and ints only: every value is a Python int holding the signed int64 (or int32)
pattern the tensors hold, so results compare directly with ``tensor.tolist()``. A canary is a
list of records ``[token, position, chain, fingerprint]``; a violation row is a list of eight
ints in ``core.record`` column order. Row order is unspecified in the ops, so callers compare
sorted rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcanary.core.hashing import ANCHOR, GOLDEN, MASK64, link, splitmix64, to_signed
from kvcanary.core.record import Reason
from kvcanary.ops.fingerprint import FingerprintMode, KVSource

Row = list[int]
# the oracle's own constants (not imported from the ops, so a changed one there is seen here)
FP_SEED = 0x66696E6765727072  # "fingerpr"
PARTIAL_BYTES = 16  # partial mode: the first 16 bytes of each source row (DESIGN.md)


def to_int32(x: int) -> int:
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >> 31 else x


# --- scatter_req_token_ids -----------------------------------------------------------------

def scatter_req_token_ids(flat_in: list[int], offsets: list[int], req_pool_indices: list[int],
                          pool_out: list[list[int]], width: int, starts: list[int] | None = None) -> list[list[int]]:
    """``pool_out[row_r, s : s + n] = int32(flat_in[off_r : off_r + n])``, ``s = starts[r]`` (0
    without starts), ``n = min(len_r, width - s)``."""
    out = [list(row) for row in pool_out]
    for r, row in enumerate(req_pool_indices):
        s = starts[r] if starts is not None else 0
        n = min(offsets[r + 1] - offsets[r], width - s)
        for c in range(n):
            out[row][s + c] = to_int32(flat_in[offsets[r] + c])
    return out


# --- gather_expected_tokens ----------------------------------------------------------------

def gather_expected_tokens(truth: list[list[int]], width: int, truth_lens: list[int], req_pool_indices: list[int],
                           prefix_lens: list[int], extend_offsets: list[int], input_ids: list[int],
                           shift: int = 0) -> list[int]:
    out = list(input_ids)
    for r, row in enumerate(req_pool_indices):
        for t in range(extend_offsets[r], extend_offsets[r + 1]):
            p = prefix_lens[r] + (t - extend_offsets[r]) + shift
            if row >= 1 and 0 <= p < min(truth_lens[r], width):
                out[t] = truth[row][p]
    return out


# --- build_plan ----------------------------------------------------------------------------

PLAN_FIELDS = ("slot", "pred", "position", "token", "count", "enable", "overflow", "verify_offsets",
               "write_offsets", "seed", "entry", "row")


def translate(slot: int, lut: list[int] | None) -> int:
    """T of plan.py: through the LUT (outside it: -1), then 0 -> -1."""
    if lut is not None:
        slot = lut[slot] if 0 <= slot < len(lut) else -1
    return -1 if slot == 0 else slot


def build_plan(req_pool_indices: list[int], prefix_lens: list[int], extend_lens: list[int],
               req_to_token: list[list[int]], max_ctx: int, plan: dict[str, list[int]],
               truth: list[list[int]] | None = None, truth_width: int = 0, truth_lens: list[int] | None = None,
               lut: list[int] | None = None, window: int = 0) -> dict[str, list[int]]:
    """A new plan (dict of field -> list) from the old buffers ``plan`` and one forward."""
    new = {k: list(v) for k, v in plan.items()}
    rows = len(req_to_token)
    entries, voff, woff, seed = [], [0], [0], []
    for r, row in enumerate(req_pool_indices):
        active = 1 <= row < rows
        end = min(max(prefix_lens[r], 0), max_ctx)
        lo = max(end - window, 0) if window else 0
        if active:
            for p in range(lo, end):
                slot = translate(req_to_token[row][p], lut)
                pred = translate(req_to_token[row][p - 1], lut) if p > 0 else -1
                known = truth is not None and p < truth_lens[r] and p < truth_width
                entries.append((slot, pred, p, truth[row][p] if known else -1, req_to_token[row][p], row))
        voff.append(len(entries))
        woff.append(woff[-1] + max(extend_lens[r], 0))
        seed.append(translate(req_to_token[row][end - 1], lut) if active and end > 0 else -1)
    cap = len(new["slot"])
    for e, (slot, pred, p, tok, entry, row) in enumerate(entries[:cap]):
        new["slot"][e], new["pred"][e], new["position"][e], new["token"][e] = slot, pred, p, tok
        new["entry"][e], new["row"][e] = entry, row
    new["count"] = [len(entries)]
    new["enable"] = [int(len(entries) <= cap)]
    new["overflow"] = [new["overflow"][0] + int(len(entries) > cap)]
    bs = len(req_pool_indices)
    new["verify_offsets"][: bs + 1] = voff
    new["write_offsets"][: bs + 1] = woff
    new["seed"][:bs] = seed
    return new


# --- stamp ---------------------------------------------------------------------------------

def stamp(words: list[list[int]], out_cache_loc: list[int], input_ids: list[int], positions: list[int],
          req_pool_indices: list[int], prefix_lens: list[int], write_offsets: list[int], seed: list[int], tag: int,
          expected_tokens: list[int] | None = None, lut: list[int] | None = None
          ) -> tuple[list[list[int]], list[Row], int]:
    """Returns (new records, violation rows, number of slots stamped). Seeds are read before any write."""
    num_slots = len(words)
    new = [list(w) for w in words]
    rows, stamped = [], 0
    for r, req_row in enumerate(req_pool_indices):
        s = seed[r]
        seed_ok = 0 < s < num_slots
        if seed_ok:
            s_tok, s_pos, s_chain, _ = words[s]
            acc = (s_chain + link(s_tok, s_pos)) & MASK64
        else:
            acc = ANCHOR
        for j, t in enumerate(range(write_offsets[r], write_offsets[r + 1])):
            tok, pos = input_ids[t], positions[t]
            chain, acc = acc, (acc + link(tok, pos)) & MASK64
            slot = translate(out_cache_loc[t], lut) if lut is not None else out_cache_loc[t]
            if req_row == 0:
                continue
            if 0 < slot < num_slots:
                new[slot] = [tok, pos, to_signed(chain), 0]
                stamped += 1
            want_pos = prefix_lens[r] + j
            if pos == want_pos and j == 0 and seed_ok and words[s][1] + 1 != pos:
                want_pos = words[s][1] + 1
            exp_tok = expected_tokens[t] if expected_tokens is not None else tok
            bad = not 0 < slot < num_slots  # a real token with no slot to go to
            reasons = (Reason.WRITE_POSITION * (pos != want_pos) + Reason.WRITE_TOKEN * (tok != exp_tok)
                       + Reason.BAD_ENTRY * bad)
            if reasons:
                stored, want = (pos, want_pos) if pos != want_pos else (tok, exp_tok)
                if bad:
                    stored, want = req_row, slot
                rows.append([tag, out_cache_loc[t] if bad else slot, pos, tok, exp_tok, stored, want, int(reasons)])
    return new, rows, stamped


# --- fingerprint ---------------------------------------------------------------------------

@dataclass(frozen=True)
class RefSource:
    """A KV source as a list of int32 words plus its geometry."""

    words: list[int]
    page_size: int
    page_stride_bytes: int
    bytes_per_token: int
    half: int = 0

    @classmethod
    def of(cls, src: KVSource) -> RefSource:
        stride = src.page_stride_bytes or src.page_size * src.bytes_per_token
        return cls(src.words.cpu().tolist(), src.page_size, stride, src.bytes_per_token, int(src.half))


def fingerprint_slot(slot: int, sources: list[RefSource], mode: FingerprintMode) -> int:
    """The word fold of fingerprint.py for one valid slot (signed)."""
    return fingerprint_parts(slot, sources, mode)[0]


def fingerprint_parts(slot: int, sources: list[RefSource], mode: FingerprintMode) -> tuple[int, int]:
    """(fingerprint, side word) of one valid slot, both signed: the side word holds the low 16
    bits of source i's mixed part in bits 16i..16i+15."""
    total = tags = 0
    for i, src in enumerate(sources):
        n_bytes = PARTIAL_BYTES if mode is FingerprintMode.PARTIAL else src.bytes_per_token
        n_words = min(n_bytes, src.bytes_per_token) // 4
        start = ((slot // src.page_size) * src.page_stride_bytes + (slot % src.page_size) * src.bytes_per_token) // 4
        acc = 0
        for w in range(n_words):
            acc += (src.words[start + w] & 0xFFFFFFFF) * ((2 * w + 1) * GOLDEN)
        part = splitmix64((acc + (i + 1) * GOLDEN) & MASK64)
        total += part
        tags |= (part & 0xFFFF) << (16 * i)
    return to_signed(splitmix64(FP_SEED ^ (total & MASK64))), to_signed(tags)


def mismatch_tag(tag: int, stored_tags: int, exp_tags: int, sources: list[RefSource]) -> int:
    """The tag column of a fingerprint failure: the half of the first source whose 16-bit part
    differs (the first source's when none does), the mask of differing sources from bit 8."""
    differ = [i for i in range(len(sources)) if ((stored_tags ^ exp_tags) & MASK64) >> (16 * i) & 0xFFFF]
    half = sources[differ[0]].half if differ else sources[0].half
    return (tag & ~1) | half | (sum(1 << i for i in differ) << 8)


def fingerprint(slots: list[int], sources: list[RefSource], mode: FingerprintMode, words: list[list[int]],
                record: bool = False, tags: list[int] | None = None
                ) -> tuple[list[int], list[list[int]], list[int]]:
    """Returns (fingerprint per slot, new records, new side words). Invalid slots give 0; mode
    NONE gives 0 (and records a 0 side word)."""
    num_slots = len(words)
    new = [list(w) for w in words]
    new_tags = list(tags) if tags is not None else [0] * num_slots
    out = []
    for s in slots:
        ok = 0 < s < num_slots
        fp, side = fingerprint_parts(s, sources, mode) if ok and mode is not FingerprintMode.NONE and sources \
            else (0, 0)
        out.append(fp)
        if ok and record:
            new[s][3] = fp
            new_tags[s] = side
    return out, new, new_tags


# --- verify --------------------------------------------------------------------------------

def verify(words: list[list[int]], plan: dict[str, list[int]], tag: int, sources: list[RefSource] = (),
           mode: FingerprintMode = FingerprintMode.NONE, tags: list[int] | None = None) -> tuple[list[Row], int]:
    """Returns (violation rows, number of slots checked); the launch count is always one.
    ``tags``: the side words (zeros when None)."""
    num_slots = len(words)
    tags = tags if tags is not None else [0] * num_slots
    cap = len(plan["slot"])
    limit = min(plan["count"][0], cap) if plan["enable"][0] else 0
    check_fp = mode is not FingerprintMode.NONE and len(sources) > 0
    rows, checked = [], 0
    for e in range(limit):
        slot, pred, epos, etok = plan["slot"][e], plan["pred"][e], plan["position"][e], plan["token"][e]
        if slot == 0:
            continue
        checked += 1
        if not 0 < slot < num_slots:  # a bad entry: named by its value, position and page-table row
            rows.append([tag, plan["entry"][e], epos, -1, etok, plan["row"][e], slot, int(Reason.BAD_ENTRY)])
            continue
        tok, pos, chain, fp = words[slot]
        if 0 < pred < num_slots:
            p_tok, p_pos, p_chain, _ = words[pred]
            exp_chain = to_signed(p_chain + link(p_tok, p_pos))
        else:
            exp_chain = None if epos != 0 else to_signed(ANCHOR)
        exp_fp, exp_tags = fingerprint_parts(slot, sources, mode) if check_fp else (fp, 0)
        checks = [(Reason.CHAIN, exp_chain is not None and chain != exp_chain, chain, exp_chain),
                  (Reason.POSITION, pos != epos, pos, epos),
                  (Reason.FINGERPRINT, fp != exp_fp, fp, exp_fp),
                  (Reason.VERIFY_TOKEN, etok != -1 and tok != etok, tok, etok)]
        failed = [c for c in checks if c[1]]
        if failed:
            reasons = sum(int(c[0]) for c in failed)
            row_tag = mismatch_tag(tag, tags[slot], exp_tags, sources) if fp != exp_fp else tag
            rows.append([row_tag, slot, pos, tok, etok, failed[0][2], failed[0][3], reasons])
    return rows, checked


# --- check_writes --------------------------------------------------------------------------

def check_writes(plan: dict[str, list[int]], out_cache_loc: list[int], input_ids: list[int], positions: list[int],
                 req_pool_indices: list[int], write_offsets: list[int], num_slots: int, tag: int,
                 lut: list[int] | None = None, held: list[int] | None = None) -> list[Row]:
    """Violation rows of conflicts.py: later writers of a slot, writes into read or held slots."""
    limit = min(max(plan["count"][0], 0), len(plan["slot"])) if plan["enable"][0] else 0
    readers: dict[int, int] = {}
    for e in range(limit):
        readers[plan["slot"][e]] = min(readers.get(plan["slot"][e], plan["row"][e]), plan["row"][e])
    for s in held or []:
        readers[s] = 0
    first: dict[int, int] = {}
    rows = []
    for r, row in enumerate(req_pool_indices):
        for t in range(write_offsets[r], write_offsets[r + 1]):
            slot = translate(out_cache_loc[t], lut)
            if not 0 < slot < num_slots:
                continue
            reasons, other = 0, 0
            if slot in first:
                reasons, other = int(Reason.WRITE_CONFLICT), req_pool_indices[first[slot]]
            else:
                first[slot] = r
            if slot in readers:
                reasons |= int(Reason.READ_CONFLICT)
                other = other if reasons & Reason.WRITE_CONFLICT else readers[slot]
            if reasons:
                rows.append([tag, slot, positions[t], input_ids[t], -1, row, other, reasons])
    return rows


# --- mark_writes / check_writes_landed -------------------------------------------------------

MARK_SEED = 0x6D697373696E6721  # "missing!"


def mark(slot: int) -> list[int]:
    """The four int32 words (signed) HEAD writes into the first 16 bytes of a write target's row."""
    out = []
    for k in range(2):
        m = splitmix64(((slot ^ MARK_SEED) + k * GOLDEN) & MASK64)
        out += [m & 0xFFFFFFFF, m >> 32]
    return [to_int32(w) for w in out]


def _row_start(src: RefSource, slot: int) -> int:
    return ((slot // src.page_size) * src.page_stride_bytes + (slot % src.page_size) * src.bytes_per_token) // 4


def mark_writes(sources: list[RefSource], out_cache_loc: list[int], num_slots: int, lut: list[int] | None = None
                ) -> list[list[int]]:
    """The sources' words after HEAD marked every valid write target."""
    out = [list(src.words) for src in sources]
    for loc in out_cache_loc:
        slot = translate(loc, lut) if lut is not None else loc
        if 0 < slot < num_slots:
            for words, src in zip(out, sources, strict=True):
                start = _row_start(src, slot)
                words[start: start + 4] = mark(slot)
    return out


def check_writes_landed(sources: list[RefSource], halves: list[int], out_cache_loc: list[int], input_ids: list[int],
                        positions: list[int], num_slots: int, tag: int, lut: list[int] | None = None
                        ) -> tuple[list[Row], list[bool]]:
    """(MISSED_WRITE rows, landed per token)."""
    rows, landed = [], []
    for loc, tok, pos in zip(out_cache_loc, input_ids, positions, strict=True):
        slot = translate(loc, lut) if lut is not None else loc
        bits = 0
        if 0 < slot < num_slots:
            for i, src in enumerate(sources):
                start = _row_start(src, slot)
                bits |= (src.words[start: start + 4] == mark(slot)) << i
        landed.append(bits == 0)
        if bits:
            first = (bits & -bits).bit_length() - 1
            rows.append([(tag & ~1) | halves[first], slot, pos, tok, -1, bits, 0, int(Reason.MISSED_WRITE)])
    return rows, landed
