"""``kv-canary run --engine transformers``: the built-in workload through Hugging Face transformers
continuous batching (a tiny random Llama of the run's model shape), with the canary attached by
``kvcanary.adapters.transformers``.

The reference engine's sizing maps onto transformers' paged cache: the same number of KV slots
in pages of ``PAGE`` tokens (so the cache runs full and requests are offloaded), prefill chunks
of ``max_tokens_per_step`` tokens, prefix sharing on. Requests arrive all at once and are never
aborted (the manager API has no step clock to time them by).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import typer

from kvcanary.adapters.transformers import install, page_size_option
from kvcanary.core.record import LaunchPoint
from kvcanary.engine.workload import Progress
from kvcanary.errors import CanaryViolation, ConfigError
from kvcanary.faults.campaign import RunSetup

PAGE = 16


def _model(setup: RunSetup):
    from transformers import LlamaConfig, LlamaForCausalLM

    m = setup.model
    if getattr(m, "sliding_window", 0):
        raise typer.BadParameter("the transformers adapter supports full-attention models only", param_hint="--model")
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


def run_transformers(setup: RunSetup, faults: Sequence, progress: Progress | None = None) -> dict:
    """Run the workload with the canary; the report has the keys of ``build_report``."""
    if faults:
        raise typer.BadParameter("--fault drives the reference engine's hooks; with --engine transformers the "
                                 "fault matrix is the adapter's test suite (tests/adapters)", param_hint="--fault")
    model = _model(setup)
    try:
        kv = install(model, setup.canary, max_ctx=model.config.max_position_embeddings)
    except ConfigError as e:
        raise typer.BadParameter(str(e), param_hint="--engine") from None
    with kv:
        results, seconds = _generate(model, setup, progress)
        try:
            kv.flush()
            error = kv.error
        except CanaryViolation as e:
            error = str(e)
    return _report(setup, kv, results, seconds, error)


def _report(setup: RunSetup, kv, results: dict, seconds: float, error: str | None) -> dict:
    totals, stats = kv.totals(), kv.stats
    counters = [a.canary.counters() for a in kv.attachments]
    point = lambda p, k: sum(c[p.name][k] for c in counters)
    failed = [r for r in results.values() if getattr(r, "error", None)]
    if failed and error is None:
        error = f"{len(failed)} request(s) failed inside transformers; first: {failed[0].error}"
    violations = kv.violations
    return {
        "engine_name": "transformers", "transformers_version": kv.version,
        "requests": setup.workload.num_requests, "finished": len(results) - len(failed), "aborted": 0,
        "prompt_tokens": sum(len(r.prompt_ids) for r in setup.workload.requests),
        "generated_tokens": sum(len(r.generated_tokens) for r in results.values()),
        "steps": stats.forwards, "step_seconds": seconds,
        "violations": max(sum(c["ring_total"] for c in counters), len(violations)),
        "violations_decoded": len(violations),
        "by_reason": dict(sorted(totals["by_reason"].items())),
        "by_launch_point": {p.name: totals["by_launch_point"].get(p.name, 0) for p in LaunchPoint},
        "canary_time_share": totals["seconds"] / seconds if seconds > 0 else 0.0,
        "canary_seconds": totals["seconds"], "wall_seconds": seconds,
        "protected_slots": point(LaunchPoint.HEAD, "stamped"),
        "verified_slots": sum(point(p, "checked") for p in LaunchPoint),
        "sweeps": totals["sweeps"], "watchdog_alarms": len(kv.alarms), "stopped": error,
        "engine": {"num_evicted_slots": 0, "num_offloaded_slots": stats.offloaded_slots,
                   "num_loaded_slots": stats.restored_slots, "num_aborts": 0, "num_preemptions": 0,
                   "num_recomputes": 0, **{f"adapter_{k}": v for k, v in stats.as_dict().items()}},
        "canary": {k: v for k, v in totals.items() if k not in ("by_reason", "by_launch_point")},
        "injections": [],
        "config": {"policy": setup.canary.policy.value, "real_kv": setup.canary.real_kv.name.lower(),
                   "sweep_interval": setup.canary.sweep_interval, "sweep_budget": setup.canary.sweep_budget_bytes,
                   "truth": setup.canary.truth, "device": setup.engine.device, "page_size": PAGE},
        "first_violations": [v.to_json() for v in violations[:20]],
    }
