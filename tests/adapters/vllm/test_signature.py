"""The scheduler's step messages carry the layout of the blocks they name (per KV cache group: record
version, block size, K/V dtype, KV heads, head dim, model); a worker whose own layout differs in any
one of them refuses the message before it takes anything, naming both values. Unit level: the two
halves of the adapter built directly, no vLLM engine started."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch

from kvcanary.adapters.vllm.layouts import Layout
from kvcanary.adapters.vllm.messages import BLOCK_FIELDS, layout_words
from kvcanary.adapters.vllm.scheduler_side import SchedulerSide
from kvcanary.adapters.vllm.settings import AdapterSettings
from kvcanary.adapters.vllm.worker_side import GroupSpec, WorkerSide
from kvcanary.core.record import RECORD_VERSION
from kvcanary.errors import KVCanaryError

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
SPEC = GroupSpec(0, LAYERS, 16, 2, 32, 0, "float32", "tiny-llama@0123abc")
NUM_BLOCKS = 12
# field -> (the worker's GroupSpec change, the error's "<field> sender .. receiver ..")
CASES = {
    "record_version": ({}, f"record_version sender {RECORD_VERSION + 1} receiver {RECORD_VERSION}"),
    "page_size": ({"block_size": 32}, "page_size sender 16 receiver 32"),
    "dtype": ({"dtype": "bfloat16"}, "dtype sender 'float32' receiver 'bfloat16'"),
    "num_kv_heads": ({"num_heads": 4}, "num_kv_heads sender 2 receiver 4"),
    "head_dim": ({"head_dim": 64}, "head_dim sender 32 receiver 64"),
    "model": ({"model": "tiny-llama@fedcba9"}, "model sender 'tiny-llama@0123abc' receiver 'tiny-llama@fedcba9'"),
}


def _scheduler(spec: GroupSpec = SPEC) -> SchedulerSide:
    return SchedulerSide(AdapterSettings(), [spec.block_size], 4, (layout_words(spec.layout()),))


def _message(side: SchedulerSide):
    """The scheduler's message for one new request of 40 prompt tokens in blocks 3, 7 and 5."""
    prompt = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    new = SimpleNamespace(req_id="r0", num_computed_tokens=0, prompt_token_ids=prompt, block_ids=([3, 7, 5],))
    cached = SimpleNamespace(req_ids=[], num_computed_tokens=[], resumed_req_ids=set(), new_block_ids=[])
    so = SimpleNamespace(finished_req_ids=set(), preempted_req_ids=set(), num_scheduled_tokens={"r0": 40},
                         scheduled_new_reqs=[new], scheduled_cached_reqs=cached)
    side.on_new_request(SimpleNamespace(request_id="r0", all_token_ids=prompt))
    return side.build(so)


def _worker(spec: GroupSpec) -> WorkerSide:
    """A worker with its canary registered over CPU caches of vLLM's CPU layout ``[B, H, N, 2*D]``."""
    worker = WorkerSide(AdapterSettings(), [spec], Layout.CPU, 128, 4)
    gen = torch.Generator().manual_seed(5)
    dtype = getattr(torch, spec.dtype)
    worker.register_kv_caches({name: torch.randn(NUM_BLOCKS, spec.num_heads, spec.block_size, 2 * spec.head_dim,
                                                 generator=gen).to(dtype) for name in spec.layer_names})
    return worker


def _state(worker: WorkerSide) -> list:
    g = worker.groups[0]
    return [g.canary.state.records.clone(), g.canary.state.source_tags.clone(), g.req_to_token.clone(),
            [dict(x) for x in worker.request_blocks]]


def test_the_workers_canary_carries_the_layout_the_scheduler_sends():
    worker = _worker(SPEC)
    own = worker.groups[0].canary.signature
    assert own.differences(SPEC.layout(), BLOCK_FIELDS) == []
    assert (own.page_size, own.dtype, own.num_kv_heads, own.head_dim, own.model) == (16, "float32", 2, 32,
                                                                                     "tiny-llama@0123abc")


@pytest.mark.parametrize("field", list(CASES))
def test_a_worker_refuses_a_message_of_another_block_layout_before_taking_it(field):
    changes, message = CASES[field]
    scheduler = _scheduler()
    if field == "record_version":  # a scheduler process of another kv-canary record layout
        scheduler.layout = (layout_words(dataclasses.replace(SPEC.layout(), record_version=RECORD_VERSION + 1)),)
    worker = _worker(dataclasses.replace(SPEC, **changes))
    msg = _message(scheduler)
    assert msg.requests["r0"][0] > 0 and msg.blocks["r0"] == (True, [[3, 7, 5]])
    before = _state(worker)
    with pytest.raises(KVCanaryError, match=rf"^StepMessage of KV cache group 0: signature mismatch: "
                                            rf"{re.escape(message)} \("):
        worker.bind(msg)
    assert worker.message is None
    after = _state(worker)
    assert all(torch.equal(a, b) for a, b in zip(before[:3], after[:3], strict=True)) and before[3] == after[3]


def test_a_worker_of_the_same_layout_takes_every_message_and_a_missing_group_is_refused():
    scheduler, worker = _scheduler(), _worker(SPEC)
    msg = _message(scheduler)
    worker.bind(msg)
    assert worker.message is msg
    # a message pickled between processes holds an equal copy of the layout: taken as well
    copy = dataclasses.replace(msg, layout=(tuple(list(msg.layout[0])),))
    assert copy.layout[0] is not msg.layout[0]
    worker.bind(copy)
    assert worker.message is copy
    worker.clear()
    for bad, got in (((), "0 groups"), ((msg.layout[0][:5],), re.escape(repr((msg.layout[0][:5],))))):
        with pytest.raises(KVCanaryError, match=rf"StepMessage.layout must hold the {re.escape(str(BLOCK_FIELDS))} "
                                                rf"of every KV cache group of this worker \(1\), got {got}; "):
            worker.bind(dataclasses.replace(msg, layout=bad))
        assert worker.message is None
