"""The adapter's connector with one fault injected, for tests that run vLLM in its own processes.

``KVCANARY_TEST_VLLM_FAULT=flip_on_hit`` (read in each worker process): at the first forward in
which a request reads prefix-cache blocks (a hit), a bit of a covered value of the first of those
blocks flips before HEAD (HEAD checks records; the fingerprint mismatch is TAIL's to find).
"""

from __future__ import annotations

import os

import torch

from kvcanary.adapters.vllm.connector import KVCanaryConnector
from kvcanary.adapters.vllm.layouts import Geometry, logical_views

BIT = 1 << 20
OFFSET = 5


class FaultyCanaryConnector(KVCanaryConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        if self.worker_side is not None and os.environ.get("KVCANARY_TEST_VLLM_FAULT") == "flip_on_hit":
            self.worker_side.hooks.append(_FlipOnHit(self.worker_side))


class _FlipOnHit:
    def __init__(self, worker):
        self.worker, self.fired = worker, False

    def __call__(self, point, view):
        if point != "head" or self.fired:
            return
        g = self.worker.groups[0]
        md = view.attn_metadata[g.layer_names[0]]
        msg = self.worker.message
        for i, rid in enumerate(view.req_ids):
            prefix = int(md.seq_lens[i]) - int(md.query_start_loc[i + 1] - md.query_start_loc[i])
            if msg.requests[rid][1] == 0 and prefix > OFFSET:
                block = int(md.block_table[i, 0])
                kv = self.worker.kv_caches[g.layer_names[0]]
                geo = Geometry(kv.shape[0], g.spec.block_size, g.spec.num_heads, g.spec.head_dim)
                value = logical_views(kv, g.layout, geo)[1]
                word = value[block, OFFSET, 0, 1:2].view(torch.int32)
                word ^= BIT
                self.fired = True
                return
