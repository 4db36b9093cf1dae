"""CUDA: an eager forward's HEAD and TAIL as graph replays (``CanaryConfig.eager_graphs``).

An eager forward launches HEAD and TAIL between its model's launches, where the engine's host is
the step's bottleneck: each bound launch (``ops.bound.BoundCheck``) checks, keys and passes 57
arguments, about 90 and 110 µs of host time an eager forward on an H200. Here each is a graph
replay instead, one graph each per bucket of batch sizes: the batch's tensors are copied into the
bucket's fixed buffers, padding included, in one ``torch._foreach_copy_`` (``EagerBuffers``),
then the bucket's HEAD graph replays; TAIL replays its own graph over the same buffers.

A bucket: the batch size and its token count, each rounded up to a power of two (at most
``max_bs``, ``max_tokens``); for a HEAD that scatters the batch's token truth, the truth ids'
count rounded up too, and whether they are appends (``ForwardBatch.truth_starts``); the page
table (its address and layout, which a graph holds). Its padding leaves every check as the batch
alone would make it (``tests/runtime/test_eager_graphs.py`` compares the bytes):

| padded      | value             | why the kernel passes it by                                   |
|-------------|-------------------|---------------------------------------------------------------|
| request     | row 0, prefix 0;  | row 0 is inactive: nothing verified, nothing of its tokens    |
|             | the first one     | stamped or reported; the extends still add up to the token    |
|             | owns the padded   | count, as ``check_forward`` requires (a bucket with padded    |
|             | tokens, the rest  | tokens has a padded request: its batch size is rounded up     |
|             | none              | past the batch's where they are equal); at most a page-table  |
|             |                   | row of them, the extend a request may have (where rounding    |
|             |                   | up would pad more, the bucket takes the batch's token count)  |
| token       | slot 0            | slot 0 is reserved: no mark, no stamp, no fingerprint         |
| truth       | the first padded  | the kernel checks that the offsets end at the ids' count; the |
| offsets     | request's segment | padded request's segment is scattered into row 0 (padding)    |
|             | ends at capacity  |                                                               |

The held slots are read counted on the device (``ops.conflicts``), as every replayed HEAD does.
A bucket's two graphs are captured at its first batch (on a stream of their own; nothing runs
then), once; a batch no bucket takes (a window pool's, one the bound check refuses, one past the
graph limit) is launched as before. TAIL checks the batch as HEAD loaded it. On the CPU (the
Triton kernel interpreted, for tests) a bucket captures nothing: its HEAD and TAIL launch the
bound checks over its buffers, so the tests run the same buckets, padding and pairing there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kvcanary.ops.bound import BoundCheck
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.capture import collection_paused

MAX_GRAPHS = 128  # buckets captured at most: a page table that moves every step must not leak graphs

log = logging.getLogger("kvcanary")


def bucket(k: int, cap: int) -> int:
    """The power of two >= ``k`` (at least 1), at most ``cap``."""
    return min(1 << max(k - 1, 0).bit_length(), cap)


class EagerBuffers:
    """One bucket's fixed batch: int64 buffers of ``bs`` requests and ``n`` tokens, and with
    ``n_tids`` the truth ids (that many), offsets (bs + 1) and, with ``starts``, appends' start
    columns (bs) of a HEAD that scatters them. ``load`` fills them from a batch at most that
    large, padding included (module doc), in one copy launch."""

    def __init__(self, bs: int, n: int, n_tids: int | None, starts: bool, device):
        i64 = dict(dtype=torch.int64, device=device)
        self.bs, self.n, self.n_tids = bs, n, n_tids
        self.rpi, self.prefix, self.extend = (torch.zeros(bs, **i64) for _ in range(3))
        # never an empty allocation: the kernel takes each address (an empty tensor has none)
        self.ids, self.pos, self.loc = (torch.zeros(max(n, 1), **i64)[:n] for _ in range(3))
        self.tids = torch.zeros(max(n_tids, 1), **i64)[:n_tids] if n_tids is not None else None
        self.toff = torch.zeros(bs + 1, **i64) if n_tids is not None else None
        self.starts = torch.zeros(bs, **i64) if n_tids is not None and starts else None
        self._zeros = torch.zeros(max(bs, n), **i64)
        self._counts = torch.arange(n + 1, **i64)  # the first padded request's extend: n - the batch's tokens
        self._ends = torch.full((bs,), n_tids, **i64) if n_tids is not None else None

    def batch(self, req_to_token: torch.Tensor) -> tuple:
        """The seven tensors of a bound check's batch, over these buffers and ``req_to_token``."""
        return self.rpi, self.prefix, self.extend, req_to_token, self.ids, self.pos, self.loc

    def load(self, rpi, prefix, extend, ids, pos, loc, tids=None, toff=None, starts=None) -> None:
        """Copy a batch (int64 vectors on the buffers' device: bs requests, n tokens, and the truth
        scatter's tensors where the buffers have them) into the buffers, padding the rest; a batch
        of fewer tokens than the buffers hold has fewer requests too (the module doc)."""
        bs, n = rpi.shape[0], ids.shape[0]
        nt = tids.shape[0] if self.toff is not None else 0
        if bs >= self.bs and (n < self.n or nt < (self.n_tids or 0)):
            raise ValueError(f"a batch of {bs} requests, {n} tokens and {nt} truth ids in buffers of {self.bs}, "
                             f"{self.n} and {self.n_tids}: padded tokens and truth ids need a padded request")
        dst, src = [self.rpi[:bs], self.prefix[:bs], self.extend[:bs]], [rpi, prefix, extend]
        if n:
            dst += [self.ids[:n], self.pos[:n], self.loc[:n]]
            src += [ids, pos, loc]
        if bs < self.bs:
            zeros = self._zeros[: self.bs - bs]
            dst += [self.rpi[bs:], self.prefix[bs:], self.extend[bs: bs + 1]]
            src += [zeros, zeros, self._counts[self.n - n: self.n - n + 1]]
            if bs + 1 < self.bs:
                dst.append(self.extend[bs + 1:])
                src.append(zeros[1:])
        if n < self.n:
            dst.append(self.loc[n:])
            src.append(self._zeros[: self.n - n])
        if self.toff is not None:
            if nt:
                dst.append(self.tids[:nt])
                src.append(tids)
            dst.append(self.toff[: bs + 1])
            src.append(toff)
            if bs < self.bs:  # the first padded request's segment ends at the capacity, the others are empty
                dst.append(self.toff[bs + 1:])
                src.append(self._ends[: self.bs - bs])
            if self.starts is not None:
                dst.append(self.starts[:bs])
                src.append(starts)
                if bs < self.bs:
                    dst.append(self.starts[bs:])
                    src.append(self._zeros[: self.bs - bs])
        torch._foreach_copy_(dst, src, non_blocking=True)


class _Graphs:
    """A bucket's buffers and its captured HEAD and TAIL (or ``_Launched``)."""

    __slots__ = ("buffers", "head", "tail")

    def __init__(self, buffers: EagerBuffers, head, tail):
        self.buffers, self.head, self.tail = buffers, head, tail


class _Launched:
    """A bucket's HEAD or TAIL where nothing is captured (the CPU, where the tests run the same
    buckets through the interpreted kernel): ``replay`` launches it over the bucket's buffers."""

    __slots__ = ("launch",)

    def __init__(self, launch: Callable[[], bool]):
        self.launch = launch

    def replay(self) -> None:
        if not self.launch():
            raise AssertionError("a bucket's bound check refused the buffers it took when the bucket was made")


class EagerGraphs:
    """The eager HEAD and TAIL of a canary as graph replays (module doc). ``head`` and ``tail``:
    the canary's bound checks (HEAD on the current stream, marking the sources; TAIL, publishing
    the counter block where ``publish``); ``tags``: (HEAD's, TAIL's); ``held_words``: the counted
    held slots every HEAD reads; ``check``: raises where the buffers the graphs hold moved
    (``DeviceState.check``), called before every replay. On the CPU (the Triton kernel
    interpreted, for tests) nothing is captured: each replay launches the bound check over the
    bucket's buffers (``_Launched``)."""

    def __init__(self, head: BoundCheck, tail: BoundCheck, *, tags: tuple[int, int], held_words: torch.Tensor,
                 publish: bool, max_bs: int, max_tokens: int, check: Callable[[], None]):
        self.head_check, self.tail_check = head, tail
        self.tags, self.held_words, self.publish = tags, held_words, publish
        self.max_bs, self.max_tokens, self.check = max_bs, max_tokens, check
        self.device = held_words.device
        self.graphs: dict[tuple, _Graphs | None] = {}  # None: a bucket whose capture the bound check refused
        self.loaded: tuple[ForwardBatch, _Graphs] | None = None  # the batch HEAD loaded, for its TAIL
        self.replays = 0
        self.failure: str | None = None  # the first capture that raised (its buckets launch as before)
        self._pool = None
        self._stream: torch.cuda.Stream | None = None

    def head(self, b: ForwardBatch, truth: bool, scatter: bool) -> bool:
        """HEAD of the eager batch ``b`` as a replay (``truth``: with the truth table; ``scatter``:
        scattering ``b``'s token truth first); False, with nothing done, where no bucket takes it."""
        self.loaded = None
        batch = (b.req_pool_indices, b.prefix_lens, b.extend_lens, b.req_to_token, b.input_ids, b.positions,
                 b.out_cache_loc)
        tids, toff, starts = (b.truth_ids, b.truth_offsets, b.truth_starts) if scatter else (None, None, None)
        if scatter and (tids is None or toff is None):
            return False
        laid = self.head_check.takes(batch, truth, tids, toff, starts)
        if laid is None:
            return False
        n, bs = laid[0], laid[1]
        rtt = b.req_to_token
        nt = tids.shape[0] if scatter else 0
        n_tids = bucket(nt, 1 << 62) if scatter else None
        bs_cap, n_cap = bucket(bs, self.max_bs), bucket(n, self.max_tokens)
        if n_cap - n > laid[3]:  # one padded request owns the padded tokens: no more than a page-table row
            n_cap = n
        if bs_cap == bs and (n_cap > n or (scatter and n_tids > nt)):  # padding needs a padded request to own it
            bs_cap = bucket(bs + 1, self.max_bs)
            if bs_cap == bs:  # none fits: the batch's own sizes
                n_cap, n_tids = n, (nt if scatter else None)
        key = (bs_cap, n_cap, truth, n_tids, starts is not None, rtt.data_ptr(), tuple(rtt.shape), rtt.stride(0))
        graphs = self.graphs.get(key, False)
        if graphs is False:
            graphs = self._captured(key, rtt) if len(self.graphs) < MAX_GRAPHS else None
        if graphs is None:
            return False
        self.check()
        graphs.buffers.load(b.req_pool_indices, b.prefix_lens, b.extend_lens, b.input_ids, b.positions,
                            b.out_cache_loc, tids, toff, starts)
        graphs.head.replay()
        self.loaded = (b, graphs)
        self.replays += 1
        return True

    def tail(self, b: ForwardBatch) -> bool:
        """TAIL of ``b`` as a replay over the buffers its HEAD loaded; False, with nothing done,
        where its HEAD was not a replay."""
        loaded = self.loaded
        if loaded is None or loaded[0] is not b:
            return False
        self.loaded = None
        self.check()
        loaded[1].tail.replay()
        return True

    def _captured(self, key: tuple, rtt: torch.Tensor) -> _Graphs | None:
        """``_capture``, where a capture that raises leaves its bucket to the bound launches (named
        once in the log and in ``failure``) instead of failing the forward."""
        try:
            return self._capture(key, rtt)
        except RuntimeError as e:
            self.graphs[key] = None
            if self.failure is None:
                self.failure = f"{type(e).__name__}: {e}"
                log.warning("kv_canary eager graphs: a capture failed, its bucket launches as before: %s",
                            self.failure)
            return None

    def _capture(self, key: tuple, rtt: torch.Tensor) -> _Graphs | None:
        """The bucket ``key``'s buffers and graphs (nothing runs); None where a bound check refuses
        the bucket's batch (kept, so that it is not tried again)."""
        bs, n, truth, n_tids, starts = key[:5]
        buffers = EagerBuffers(bs, n, n_tids, starts, self.device)
        batch = buffers.batch(rtt)
        scatter = dict(truth_ids=buffers.tids, truth_offsets=buffers.toff, truth_starts=buffers.starts) \
            if n_tids is not None else {}
        if self.device.type != "cuda":
            if self.head_check.takes(batch, truth, **scatter) is None:
                self.graphs[key] = None
                return None
            graphs = self.graphs[key] = _Graphs(buffers, _Launched(
                lambda: self.head_check(*batch, tag=self.tags[0], truth=truth, held_words=self.held_words,
                                        **scatter)),
                _Launched(lambda: self.tail_check(*batch, tag=self.tags[1], truth=truth, publish=self.publish)))
            return graphs
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
            self._pool = torch.cuda.graph_pool_handle()
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        head, tail = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        taken = []
        with collection_paused(), torch.cuda.stream(self._stream):
            for graph, launch in (
                    (head, lambda: self.head_check(*batch, tag=self.tags[0], truth=truth,
                                                   held_words=self.held_words, **scatter)),
                    (tail, lambda: self.tail_check(*batch, tag=self.tags[1], truth=truth,
                                                   publish=self.publish))):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    taken.append(launch())
                finally:
                    graph.capture_end()
        current.wait_stream(self._stream)
        graphs = _Graphs(buffers, head, tail) if all(taken) else None
        self.graphs[key] = graphs
        return graphs
