"""Build the ``ForwardBatch`` of one step from the scheduler's plan.

For request r with ``prefix_lens[r] = p`` and ``extend_lens[r] = n``, its tokens occupy
``input_ids[s : s + n]`` with ``s = sum(extend_lens[:r])``, at positions ``p .. p + n - 1``,
written to slots ``req_to_token[row_r, p .. p + n - 1]``. A request's tokens are its history
followed by its speculative drafts (``Request.draft_ids``). Padding requests (row 0, one token
0 at position 0 each) go after the real ones; their writes land in ``padding_slot``.

Token truth is each request's whole history (prompt + outputs), or, with ``appends``, what its
row's truth does not hold yet: its history from ``truth_starts[r] = Request.truth_len`` on (the
whole history for a row new to it: ``truth_len`` 0). A decode batch whose every request's row
holds its history up to the token it writes (``truth_len == num_cached``) appends that one
token a request, with fixed sizes a graph can take (a padding request appends token 0 at 0 of
row 0). Each request's ``truth_len`` then says how much of its history its row holds.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from kvcanary.engine.scheduler import Schedule
from kvcanary.engine.zoo import Bug, Zoo
from kvcanary.runtime.batch import ForwardBatch


def build_forward_batch(plan: Schedule, req_to_token: torch.Tensor, num_padding: int = 0, padding_slot: int = 0,
                        zoo: Zoo | None = None, appends: bool = False, truth: bool = True) -> ForwardBatch:
    """The forward of ``plan`` (non-empty) and ``num_padding`` padding requests. Index tensors are
    int64 on ``req_to_token``'s device; ``req_to_token`` itself is passed through, not copied.
    ``appends``: token truth as appends where the batch allows (module doc); ``truth``: build
    token truth at all (False: its fields are None, and no request's ``truth_len`` moves)."""
    device = req_to_token.device
    pad = [0] * num_padding
    rows = _as_tensor([req.row for req, _ in plan] + pad)
    prefix_lens = _as_tensor([req.num_cached for req, _ in plan] + pad)
    extend_lens = _as_tensor([n for _, n in plan] + [1] * num_padding)
    starts = torch.cumsum(extend_lens, 0) - extend_lens
    num_tokens = int(extend_lens.sum())
    positions = torch.repeat_interleave(prefix_lens - starts, extend_lens) + torch.arange(num_tokens)
    input_ids = None
    if num_tokens > len(plan) + num_padding:  # a prefill's ids: slices of the prompts' arrays
        input_list = None
        input_ids = torch.from_numpy(_input_array(plan, num_padding))
    else:  # a token a request: a list is quicker than a slice and a join
        input_list = list(itertools.chain.from_iterable(_tokens(req, req.num_cached, n) for req, n in plan)) + pad
    if not truth:
        truth_ids = truth_offsets = truth_starts = None
    elif appends and input_list is not None and all(n == 1 and not req.draft_ids and req.truth_len == req.num_cached
                                                    for req, n in plan):
        # one token a request: the offsets are 0..bs, one device tensor per size kept (nothing writes
        # a batch's tensors), and the starts are the prefix lengths (the same device tensor); the ids
        # are the input ids' values (each request's token at its prefix end, padding 0), and go to
        # the device in one copy with them, into memory of their own
        input_ids, truth_ids = _packed(device, input_list, input_list)
        truth_offsets, truth_starts = counting(len(plan) + num_padding + 1, device), prefix_lens
        for req, _ in plan:
            req.truth_len += 1
    elif appends:  # each request's history from what its row holds on (all of it for a new row)
        truth_offsets, truth_starts, truth_ids = _appended(plan, num_padding, device)
    else:
        histories = [req.token_ids for req, _ in plan] + [[]] * num_padding
        truth_ids = _as_tensor(list(itertools.chain.from_iterable(histories)))
        truth_offsets, truth_starts = _as_tensor([0, *itertools.accumulate(len(t) for t in histories)]), None
        for req, _ in plan:
            req.truth_len = req.num_tokens
    prefix_on_device = prefix_lens.to(device)
    token_rows = torch.repeat_interleave(rows, extend_lens).to(device)
    out_cache_loc = req_to_token[token_rows, positions.to(device)].to(torch.int64)
    if num_padding:
        out_cache_loc[-num_padding:] = padding_slot
    if zoo is not None and Bug.CHUNK_POSITIONS_RESTART in zoo:
        positions = _restart_chunk_positions(plan, positions, out_cache_loc, zoo)
    return ForwardBatch(
        req_pool_indices=rows.to(device),
        prefix_lens=prefix_on_device,
        extend_lens=extend_lens.to(device),
        req_to_token=req_to_token,
        input_ids=(_as_tensor(input_list) if input_ids is None else input_ids).to(device),
        positions=positions.to(device),
        out_cache_loc=out_cache_loc,
        truth_ids=None if truth_ids is None else truth_ids.to(device),
        truth_offsets=None if truth_offsets is None else truth_offsets.to(device),  # kept ones: already there
        request_ids=tuple(req.request_id for req, _ in plan) + (None,) * num_padding,
        # a decode batch's appends start where the prefix ends: the same device tensor
        truth_starts=None if truth_starts is None else prefix_on_device if truth_starts is prefix_lens
        else truth_starts.to(device),
    )


def _as_tensor(xs: list[int]) -> torch.Tensor:
    """An int64 host tensor of ``xs``, through numpy: ``torch.tensor`` converts a list element by
    element, 3x as long (124 against 41 µs for a truth of 2,400 tokens)."""
    return torch.from_numpy(np.array(xs, dtype=np.int64))


def _packed(device: torch.device, *lists: list[int]) -> list[torch.Tensor]:
    """``lists`` as int64 tensors on ``device`` from one host-to-device copy (``one_buffer``). On
    the CPU, where there is no copy to save, a tensor each."""
    if device.type == "cpu":
        return [_as_tensor(xs) for xs in lists]
    host, bounds = one_buffer(*lists)
    t = host.to(device)
    return [t[a:b] for a, b in bounds]


def one_buffer(*lists: list[int]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """``lists`` in one int64 host tensor, and each one's [start, end) in it: every part starts
    16-byte aligned, as a tensor of its own would (the kernels' compiled variants assume it)."""
    flat, bounds = [], []
    for xs in lists:
        flat += [0] * (len(flat) % 2)
        bounds.append((len(flat), len(flat) + len(xs)))
        flat += xs
    return _as_tensor(flat), bounds


_COUNTING: dict[tuple[int, torch.device], torch.Tensor] = {}


def counting(n: int, device: torch.device) -> torch.Tensor:
    """int64 [0, 1, ..., n - 1] on ``device``, made once per size and device (read, never written)."""
    t = _COUNTING.get((n, device))
    if t is None:
        t = _COUNTING[n, device] = torch.arange(n, dtype=torch.int64, device=device)
    return t


def _tokens(req, at: int, n: int) -> list[int]:
    """``(req.token_ids + req.draft_ids)[at : at + n]`` without building the whole history where
    the slice lies in one of its parts (a decode's token: its last output)."""
    num, outputs = len(req.prompt_ids), req.output_ids
    end = num + len(outputs)
    if num <= at and at + n <= end:
        return outputs[at - num: at - num + n]
    if at + n <= num:
        return req.prompt_ids[at: at + n]
    if at >= end:
        return req.draft_ids[at - end: at - end + n]
    return (req.prompt_ids + outputs + req.draft_ids)[at: at + n]


def _input_array(plan: Schedule, num_padding: int) -> np.ndarray:
    """The input ids of ``plan`` and ``num_padding`` padding requests (token 0 each) as one int64
    array: each request's slice of its prompt's array where its tokens are prompt tokens, else of
    its history and drafts."""
    parts = []
    for req, n in plan:
        at = req.num_cached
        if at + n <= len(req.prompt_ids):
            parts.append(req.prompt_array[at: at + n])
        else:
            parts.append(np.array(_tokens(req, at, n), dtype=np.int64))
    if num_padding:
        parts.append(np.zeros(num_padding, dtype=np.int64))
    return np.concatenate(parts)


def _appended(plan: Schedule, num_padding: int, device: torch.device) -> list[torch.Tensor]:
    """(offsets, starts, ids) of appends for ``plan``: each request's history from what its row
    holds on (all of it for a row new to it), padding requests appending nothing; every request's
    ``truth_len`` moves to its history's end. On a device the three go in one copy
    (``appended_buffer``)."""
    buffer, bounds = appended_buffer(plan, num_padding)
    t = torch.from_numpy(buffer)
    if device.type != "cpu":
        t = t.to(device)
    return [t[a:b] for a, b in bounds]


def appended_buffer(plan: Schedule, num_padding: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """``one_buffer(offsets, starts, ids)``'s layout of ``plan``'s appends (``_appended``) as one
    int64 array, and each part's [start, end): the ids are slices of the prompts' arrays and the
    outputs, joined once (a prefill's truth is hundreds of tokens: a list of them built and
    converted costs tens of µs between a model's launches). Moves every request's ``truth_len``
    to its history's end."""
    bs = len(plan) + num_padding
    head = bs + 1 + (bs + 1) % 2  # the offsets, then the starts 16-byte aligned, then the ids
    ids = head + bs + bs % 2
    words = [0] * ids
    parts = [None]
    at = 0
    for i, (req, _) in enumerate(plan):
        start, num = req.truth_len, len(req.prompt_ids)
        end = num + len(req.output_ids)
        if start > end:  # a row that holds more than the history: taken as new
            start = 0
        words[head + i] = start
        if start < num:
            parts.append(req.prompt_array[start:])
            if req.output_ids:
                parts.append(np.array(req.output_ids, dtype=np.int64))
        elif start < end:
            parts.append(np.array(req.output_ids[start - num:], dtype=np.int64))
        req.truth_len = end
        at += end - start
        words[i + 1] = at
    for i in range(len(plan) + 1, bs + 1):
        words[i] = at
    parts[0] = np.array(words, dtype=np.int64)
    return np.concatenate(parts), [(0, bs + 1), (head, head + bs), (ids, ids + at)]


def _restart_chunk_positions(plan: Schedule, positions: torch.Tensor, out_cache_loc: torch.Tensor,
                             zoo: Zoo) -> torch.Tensor:
    """Zoo (``Bug.CHUNK_POSITIONS_RESTART``): a prefill extend that continues a prefix gets the
    positions of its chunk (0, 1, ...) instead of its sequence's; its slots stay right."""
    positions, start = positions.clone(), 0
    for req, n in plan:
        if n > 1 and req.num_cached > 0:
            positions[start : start + n] = torch.arange(n)
            zoo.record(Bug.CHUNK_POSITIONS_RESTART, f"request={req.request_id} positions {req.num_cached}.."
                       f"{req.num_cached + n - 1} computed as 0..{n - 1}", out_cache_loc[start : start + n],
                       request_id=req.request_id, positions=range(req.num_cached, req.num_cached + n))
        start += n
    return positions
