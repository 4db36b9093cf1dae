"""Workloads and faults run inside the vLLM process (``remote``); each returns plain data to assert on.

Faults act on vLLM's real structures: the attention metadata's block table the attention kernel
reads, the KV cache tensors, the scheduler's block pool and its prefix-cache hash map. A fault
fires once; the same scenario with ``fault=False`` is its fault-free twin.
"""

from __future__ import annotations

import torch

BLOCK = 32
WORDS = ["the quick brown fox", "a paged kv cache", "prefix caching shares blocks", "kv-canary stamps",
         "every slot", "verifies it on every read", "jumps over the lazy dog", "keys and values"]


def prompt(seed: int, words: int) -> str:
    """A prompt of ``words`` phrases, the same for the same seed; different seeds differ in the first token."""
    out = [WORDS[(seed * 5 + i * (seed % 3 + 1)) % len(WORDS)] for i in range(words)]
    return f"{seed}: " + " ".join(out)


class Engine:
    def __init__(self, llm, policy: str):
        self.llm, self.policy = llm, policy
        self.seen = 0
        self.next_id = 0

    @property
    def worker(self):
        from kvcanary.adapters.vllm import install

        return install.active()

    @property
    def scheduler(self):
        return self.llm.llm_engine.engine_core.engine_core.scheduler

    @property
    def scheduler_side(self):
        return self.scheduler.connector.scheduler_side

    @property
    def block_pool(self):
        return self.scheduler.kv_cache_manager.block_pool

    def kv_value_view(self, layer: int = 0):
        """The logical V view ``[blocks, block_size, heads, dim]`` of a layer (what the canary covers)."""
        from kvcanary.adapters.vllm.layouts import logical_views

        g = self.worker.groups[0]
        kv = self.worker.kv_caches[g.layer_names[layer]]
        from kvcanary.adapters.vllm.layouts import Geometry

        geo = Geometry(kv.shape[0], g.spec.block_size, g.spec.num_heads, g.spec.head_dim)
        return logical_views(kv, g.layout, geo)[1]

    def take_violations(self) -> list[dict]:
        if self.worker is None:
            return []
        new = self.worker.violations[self.seen:]
        self.seen = len(self.worker.violations)
        return [{"point": v.tag.point.name, "pool": v.tag.pool.name, "reasons": sorted(r.lower() for r in
                 _names(v.reasons)), "slot": v.slot, "position": v.position, "step": v.step,
                 "requests": [r for r, _ in v.owners], "line": v.line()} for v in new]

    def reset(self) -> None:
        assert self.llm.reset_prefix_cache()
        self.take_violations()
        if self.worker is not None:
            self.worker.hooks.clear()

    def drive(self, arrivals: list[tuple[int, str, str, int]]) -> dict[str, dict]:
        """Run requests ``(arrival step, name, prompt, max_tokens)`` step by step, greedy; returns
        name -> {"tokens": [...], "finish_reason": ...}."""
        from vllm import SamplingParams

        engine = self.llm.llm_engine
        pending = sorted(arrivals)
        outputs, step = {}, 0
        while pending or engine.has_unfinished_requests():
            while pending and pending[0][0] <= step:
                _, name, text, max_tokens = pending.pop(0)
                params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
                engine.add_request(name, text, params)
            for out in engine.step():
                if out.finished:
                    c = out.outputs[0]
                    outputs[out.request_id] = {"tokens": list(c.token_ids), "finish_reason": c.finish_reason}
            step += 1
            assert step < 2000, "the workload did not finish"
        return outputs

    def unique(self, name: str) -> str:
        self.next_id += 1
        return f"{name}#{self.next_id}"


def _names(reasons) -> list[str]:
    from kvcanary import Reason

    return Reason.names(reasons)


def start(model_path: str, policy: str, **settings) -> Engine:
    from vllm import LLM

    from kvcanary.adapters.vllm import kv_transfer_config

    kw = {} if policy == "off" else {"kv_transfer_config": kv_transfer_config(policy=policy, **settings)}
    llm = LLM(model=model_path, enable_prefix_caching=True, block_size=BLOCK, max_model_len=1024, dtype="float32",
              max_num_batched_tokens=96, max_num_seqs=6, enforce_eager=True, kv_cache_memory_bytes=3 << 19,
              gpu_memory_utilization=0.1, seed=0, **kw)
    return Engine(llm, policy)


def _result(e: Engine, outputs: dict, **extra) -> dict:
    by_name = {name.split("#")[0]: out for name, out in outputs.items()}
    return {"outputs": by_name, "violations": e.take_violations(), **extra}


def _ours(rid: str, name: str) -> bool:
    """Whether vLLM's request id ``rid`` is the request this module named ``name`` (``unique`` adds
    ``#n``, vLLM a ``-suffix``); ``name`` may be the bare name (any request of that name)."""
    return rid == name or rid.startswith(f"{name}-") or rid.startswith(f"{name}#")


# --- workloads ----------------------------------------------------------------------------------

def clean(e: Engine) -> dict:
    """Prefix caching (shared prompts, later requests hitting earlier ones and co-scheduled ones),
    chunked prefill (prompts longer than the 96-token step budget), preemption (more KV than the
    cache holds)."""
    e.reset()
    side = e.scheduler_side if e.worker is not None else None
    hits0, pre0 = (side.prefix_hits, side.preemptions) if side else (0, 0)
    arrivals = []
    for i in range(6):
        arrivals.append((0, e.unique(f"long{i}"), prompt(i, 40), 120))
    for i in range(4):
        arrivals.append((3 + 4 * i, e.unique(f"shared{i}"), prompt(1, 40) + f" then {i}", 20))
    arrivals.append((1, e.unique("twin"), prompt(2, 40), 20))
    outputs = e.drive(arrivals)
    tokenizer = e.llm.get_tokenizer()
    prompt_len = len(tokenizer.encode(prompt(0, 40)))
    hits, pre = (side.prefix_hits - hits0, side.preemptions - pre0) if side else (0, 0)
    return _result(e, outputs, prompt_len=prompt_len, prefix_hits=hits, preemptions=pre,
                   num_blocks=e.scheduler.kv_cache_manager.block_pool.num_gpu_blocks)


def _two_requests(e: Engine, hook=None, tokens: int = 16) -> dict:
    e.reset()
    if hook is not None:
        e.worker.hooks.append(hook)
    arrivals = [(0, e.unique("a"), prompt(3, 24), tokens), (0, e.unique("b"), prompt(4, 24), tokens)]
    return e.drive(arrivals)


def repoint(e: Engine, fault: bool = True) -> dict:
    """One forward's block table (the attention metadata the kernel reads): the first block of a
    decoding request repointed to the first block of another live request, for that forward."""
    fired = {}

    def hook(point, view):
        md = view.attn_metadata[e.worker.groups[0].layer_names[0]]
        if point == "head" and not fired:
            n = len(view.req_ids)
            seq = md.seq_lens[:n]
            qlen = md.query_start_loc[1: n + 1] - md.query_start_loc[:n]
            decoding = [i for i in range(n) if int(qlen[i]) == 1 and int(seq[i]) > 2 * BLOCK + 4]
            if len(decoding) < 2:
                return
            i, j = decoding[0], decoding[1]
            fired.update(request=view.req_ids[i], other_block=int(md.block_table[j, 0]),
                         own_block=int(md.block_table[i, 0]), second_block=int(md.block_table[i, 1]),
                         step=view.step, restore=(i, int(md.block_table[i, 0])))
            if fault:
                md.block_table[i, 0] = md.block_table[j, 0]
        elif point == "tail" and fired and fired.get("step") == view.step and fault:
            i, block = fired["restore"]
            md.block_table[i, 0] = block  # a one-forward fault

    outputs = _two_requests(e, hook)
    fired.pop("restore", None)
    return _result(e, outputs, fired=fired)


def dropped_write(e: Engine, fault: bool = True) -> dict:
    """The K/V write of one decode token lost: the covered bytes of its slot keep what they held
    before the model ran (its HEAD mark), in the first covered layer."""
    fired, saved = {}, {}
    value = e.kv_value_view(0)

    def hook(point, view):
        md = view.attn_metadata[e.worker.groups[0].layer_names[0]]
        n = len(view.req_ids)
        if point == "model" and not fired:
            qlen = md.query_start_loc[1: n + 1] - md.query_start_loc[:n]
            seq = md.seq_lens[:n]
            for i in range(n):
                if int(qlen[i]) == 1 and int(seq[i]) > BLOCK + 6:
                    slot = int(md.slot_mapping[int(md.query_start_loc[i])])
                    fired.update(request=view.req_ids[i], slot=slot, step=view.step, position=int(seq[i]) - 1)
                    saved["bytes"] = value[slot // BLOCK, slot % BLOCK].clone()
                    return
        elif point == "tail" and fired.get("step") == view.step and fault and "bytes" in saved:
            slot = fired["slot"]
            value[slot // BLOCK, slot % BLOCK] = saved.pop("bytes")

    outputs = _two_requests(e, hook)
    return _result(e, outputs, fired=fired)


def flip_cached(e: Engine, fault: bool = True, wait_for_sweep: bool = False) -> dict:
    """A bit flipped in a covered value of a finished request's cached block. Then either a request
    hits that block (found at its TAIL) or idle steps run (found by a sweep); then the prompt is
    asked again (the damage must not be served: quarantine)."""
    import dataclasses

    e.reset()
    side = e.scheduler_side
    interval = side.settings
    if not wait_for_sweep:  # the hit must find it, not a sweep before it
        side.settings = dataclasses.replace(interval, sweep_interval=0)
    try:
        return _flip_cached(e, fault, wait_for_sweep)
    finally:
        side.settings = interval


def _flip_cached(e: Engine, fault: bool, wait_for_sweep: bool) -> dict:
    text = prompt(5, 24)
    first = e.drive([(0, e.unique("first"), text, 8)])
    run = next(r for rid, r in e.scheduler_side.runs.items() if _ours(rid, next(iter(first))))
    block = run[0][0]
    value = e.kv_value_view(0)
    fired = {"block": block, "slot": block * BLOCK + 5}
    if fault:
        word = value[block, 5, 0, 1:2].view(torch.int32)
        word ^= 1 << 20
    if wait_for_sweep:
        busy = e.drive([(0, e.unique("busy"), prompt(6, 10), 40)])  # > sweep_interval steps elsewhere
        first.update(busy)
    later = e.drive([(0, e.unique("again"), text, 8)])
    return _result(e, {**first, **later}, fired=fired)


def freed_reused(e: Engine, fault: bool = True) -> dict:
    """A block-pool bug: a running request's first block handed out again, as the first block of a
    request that arrives later, while the first request still reads it (reference counts kept
    consistent, so vLLM's own bookkeeping goes on; the later request's prompt stays under one
    block, so nothing caches the block twice)."""
    e.reset()
    pool, side, fired = e.block_pool, e.scheduler_side, {}
    original = side.build

    def build(so):
        late = next((nr for nr in so.scheduled_new_reqs if _ours(nr.req_id, "late")), None)
        early = next((r for r in e.scheduler.running if _ours(r.request_id, "early")), None)
        if fault and not fired and late is not None and early is not None:
            manager = e.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
            victim = manager.req_to_blocks[early.request_id][0]
            given = manager.req_to_blocks[late.req_id][0]
            victim.ref_cnt += 1
            manager.req_to_blocks[late.req_id][0] = victim
            pool.free_blocks([given])
            late.block_ids[0][0] = victim.block_id
            fired.update(block=victim.block_id, victim=early.request_id, writer=late.req_id, step=side.step + 1)
        return original(so)

    side.build = build
    try:
        outputs = e.drive([(0, e.unique("early"), prompt(7, 24), 24), (8, e.unique("late"), prompt(8, 4), 6),
                           (0, e.unique("bystander"), prompt(9, 10), 24)])
    finally:
        side.build = original
    return _result(e, outputs, fired=fired)


def hash_collision(e: Engine, fault: bool = True) -> dict:
    """A prefix-cache lookup returning the wrong block: the hash of one prompt's first block mapped
    to another prompt's cached first block, then a request with the first prompt arrives."""
    e.reset()
    x, y = prompt(10, 24), prompt(11, 24)
    done = e.drive([(0, e.unique("x"), x, 4), (0, e.unique("y"), y, 4)])
    runs = e.scheduler_side.runs
    x_run = next(r for rid, r in runs.items() if _ours(rid, next(n for n in done if n.startswith("x#"))))
    y_run = next(r for rid, r in runs.items() if _ours(rid, next(n for n in done if n.startswith("y#"))))
    pool = e.block_pool
    x_block, y_block = x_run[0][0], y_run[0][0]
    fired = {"x_block": x_block, "y_block": y_block, "x_second": x_run[0][1]}
    if fault:
        key = pool.blocks[x_block].block_hash
        pool.cached_block_hash_to_block._cache[key] = pool.blocks[y_block]
    later = e.drive([(0, e.unique("hit"), x + " and more", 12)])
    return _result(e, {**done, **later}, fired=fired)


def counters(e: Engine) -> dict:
    w = e.worker
    return {"forwards": sum(g.canary.totals.forwards for g in w.groups), "groups": len(w.groups),
            "coverage": [(g.coverage[0].name, [h.name for h in g.coverage[1]]) for g in w.groups],
            "quarantined": e.scheduler_side.quarantined}


def window_flip(e: Engine, fault: bool = True) -> dict:
    """A sliding-window model: a bit flipped in a covered value of a slot inside the window of a
    decoding request (20 positions back), before the forward that reads it."""
    e.reset()
    fired = {}
    value = e.kv_value_view(0)

    def hook(point, view):
        md = view.attn_metadata[e.worker.groups[0].layer_names[0]]
        if point != "head" or fired:
            return
        for i in range(len(view.req_ids)):
            seq = int(md.seq_lens[i])
            if int(md.query_start_loc[i + 1] - md.query_start_loc[i]) == 1 and seq > 160:
                position = seq - 20
                block = int(md.block_table[i, position // BLOCK])
                fired.update(request=view.req_ids[i], slot=block * BLOCK + position % BLOCK, position=position,
                             step=view.step, window=e.worker.groups[0].spec.window)
                if fault:
                    word = value[block, position % BLOCK, 0, 1:2].view(torch.int32)
                    word ^= 1 << 20
                return

    e.worker.hooks.append(hook)
    outputs = e.drive([(0, e.unique("a"), prompt(12, 30), 60), (0, e.unique("b"), prompt(12, 30) + " b", 60)])
    return _result(e, outputs, fired=fired)
