"""``kv-canary run --engine transformers``: the built-in workload through Hugging Face transformers
continuous batching (a tiny random Llama of the run's model shape), with the canary attached by
``kvcanary.adapters.transformers``.

The reference engine's sizing maps onto transformers' paged cache: the same number of KV slots
in pages of ``PAGE`` tokens (so the cache runs full and requests are offloaded), prefill chunks
of ``max_tokens_per_step`` tokens, prefix sharing on. Requests arrive all at once and are never
aborted (the manager API has no step clock to time them by).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Sequence

import torch

from kvcanary.adapters.transformers import install, page_size_option
from kvcanary.errors import CanaryViolation, ConfigError
from kvcanary.runs.driver import Progress, RunCounts, StepCounts
from kvcanary.runs.report import CanaryCounts, RunReport, first_violations
from kvcanary.runs.setup import MissingExtra, OptionError, RunSetup

PAGE = 16


def _model(setup: RunSetup):
    from transformers import LlamaConfig, LlamaForCausalLM

    m = setup.model
    if getattr(m, "sliding_window", 0):
        raise OptionError("the transformers adapter supports full-attention models only", "--model")
    cfg = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.hidden, intermediate_size=m.intermediate,
                      num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                      num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim, rope_theta=m.rope_theta,
                      max_position_embeddings=-(-setup.workload.max_request_len // PAGE) * PAGE)
    torch.manual_seed(m.seed)
    dtype = torch.bfloat16 if setup.engine.device == "cuda" else torch.float32
    return LlamaForCausalLM(cfg).to(device=setup.engine.device, dtype=dtype).eval()


def _cb_config(setup: RunSetup, model):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    e, m = setup.engine, setup.model
    slot_bytes = 2 * m.num_layers * m.num_kv_heads * m.head_dim * model.dtype.itemsize
    # the CPU swap pool is pinned memory, which torch only has with an accelerator: soft resets otherwise
    offload_gib = e.host_tier_slots * slot_bytes / 2**30 if torch.cuda.is_available() else 0.0
    return ContinuousBatchingConfig(**page_size_option(PAGE), num_blocks=max(4, e.num_slots // PAGE),
                                    max_batch_tokens=e.max_tokens_per_step, cpu_offload_space=offload_gib,
                                    use_async_batching=False, use_cuda_graph=False)


def _generate(model, setup: RunSetup, progress: Progress | None) -> tuple[dict, float]:
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0,
                           max_new_tokens=max(r.max_new_tokens for r in setup.workload.requests))
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=_cb_config(setup, model))
    reqs, results = setup.workload.requests, {}
    t0 = time.perf_counter()
    manager.start()
    try:
        for i, r in enumerate(reqs):
            manager.add_request(input_ids=list(r.prompt_ids), request_id=f"req_{i}", max_new_tokens=r.max_new_tokens)
        while len(results) < len(reqs) and manager.is_running():
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                results[out.request_id] = out
                if progress:
                    progress(len(results), len(reqs))
    finally:
        manager.stop(block=True)
    return results, time.perf_counter() - t0


def run_transformers(setup: RunSetup, faults: Sequence = (), progress: Progress | None = None) -> RunReport:
    """Run the workload with the canary; its report (the attachments' canaries merged)."""
    if faults:
        raise OptionError("--fault drives the reference engine's hooks; with --engine transformers the fault "
                          "matrix is the adapter's test suite (tests/adapters)", "--fault")
    if importlib.util.find_spec("transformers") is None:
        raise MissingExtra("transformers", "--engine transformers")
    model = _model(setup)
    try:
        kv = install(model, setup.canary, max_ctx=model.config.max_position_embeddings)
    except ConfigError as e:
        raise OptionError(str(e), "--engine") from None
    with kv:
        results, seconds = _generate(model, setup, progress)
        try:
            kv.flush()
            error = kv.error
        except CanaryViolation as e:
            error = str(e)
    return _report(setup, kv, results, seconds, error)


def _report(setup: RunSetup, kv, results: dict, seconds: float, error: str | None) -> RunReport:
    stats = kv.stats
    failed = [r for r in results.values() if getattr(r, "error", None)]
    if failed and error is None:
        error = f"{len(failed)} request(s) failed inside transformers; first: {failed[0].error}"
    canary = CanaryCounts.merge([CanaryCounts.of([a.canary], [v for r in a.reports for v in r.violations],
                                                 [x for r in a.reports for x in r.alarms]) for a in kv.attachments])
    reqs = setup.workload.requests
    counts = RunCounts(requests=len(reqs), finished=len(results) - len(failed), aborted=0,
                       prompt_tokens=sum(len(r.prompt_ids) for r in reqs),
                       generated_tokens=sum(len(r.generated_tokens) for r in results.values()),
                       decode=StepCounts(stats.forwards, seconds))
    c = setup.canary
    return RunReport(
        counts=counts, canary=canary,
        engine={"num_evicted_slots": 0, "num_offloaded_slots": stats.offloaded_slots,
                "num_loaded_slots": stats.restored_slots, "num_aborts": 0, "num_preemptions": 0,
                "num_recomputes": 0, **{f"adapter_{k}": v for k, v in stats.as_dict().items()}},
        config={"policy": c.policy.value, "real_kv": c.real_kv.name.lower(), "sweep_interval": c.sweep_interval,
                "sweep_budget": c.sweep_budget_bytes, "truth": c.truth, "device": setup.engine.device,
                "page_size": PAGE},
        wall_seconds=seconds, stopped=error, first_violations=first_violations(kv.violations),
        about={"engine_name": "transformers", "transformers_version": kv.version})
