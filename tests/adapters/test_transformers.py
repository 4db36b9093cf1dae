"""The transformers continuous-batching adapter on a tiny random Llama, on CPU: clean runs are
silent and unchanged, every applicable fault is reported with its exact reason and launch point."""

from __future__ import annotations

import logging

import pytest
import transformers
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

from kvcanary.adapters import transformers as adapter
from kvcanary.config import CanaryConfig, Policy
from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.errors import ConfigError

from ._faults import BlockTableSwap, CachedBlockFlip, OffloadCopyFlip, UsedBlockFlip
from ._setup import PAGE, cb_config, generate, generation_config, prompts, tiny_model

CONFIG = CanaryConfig(sweep_interval=1)
_ORDER = {LaunchPoint.SWEEP: 0, LaunchPoint.HEAD: 1, LaunchPoint.TAIL: 2}


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def reference(model):
    """Outputs without the canary."""
    return generate(model, prompts())


def run(model, hooks=()):
    with adapter.install(model, CONFIG) as kv:
        kv.step_hooks.extend(hooks)
        out = generate(model, prompts())
        kv.flush()
    return out, kv


@pytest.fixture(scope="module")
def clean(model):
    return run(model)


def first(violations):
    return min(violations, key=lambda v: (v.step, _ORDER[v.point]))


def test_clean_run_is_silent_unchanged_and_exercises_every_path(clean, reference):
    out, kv = clean
    assert out == reference
    assert kv.violations == [] and kv.alarms == []
    s, counters = kv.stats, kv.canary.counters()
    assert s.requests == len(reference) and s.forwards > 0
    assert s.prefix_hit_tokens >= 2 * PAGE and s.prefix_hit_tokens % PAGE == 0  # whole system-prompt pages
    assert s.offloaded_requests > 0 and s.restored_requests == s.offloaded_requests and s.restored_slots > 0
    assert s.swept_slots > 0 and counters["SWEEP"]["checked"] > 0
    assert counters["HEAD"]["launches"] == s.forwards and counters["HEAD"]["stamped"] >= sum(map(len, out.values()))
    assert counters["ring_total"] == 0 and counters["plan_overflows"] == 0


def test_uninstall_restores_transformers(model):
    original = ContinuousBatchingManager._create_batch_processor
    kv = adapter.install(model, CONFIG)
    assert ContinuousBatchingManager._create_batch_processor is not original
    kv.uninstall()
    assert ContinuousBatchingManager._create_batch_processor is original
    kv.uninstall()  # idempotent


@pytest.mark.parametrize("fault, point, reasons, optional", [
    (BlockTableSwap, LaunchPoint.HEAD, Reason.CHAIN | Reason.POSITION, Reason.VERIFY_TOKEN),
    (UsedBlockFlip, LaunchPoint.TAIL, Reason.FINGERPRINT, Reason(0)),
    (CachedBlockFlip, LaunchPoint.SWEEP, Reason.FINGERPRINT, Reason(0)),
], ids=["block_table_swap", "used_block_flip", "cached_block_flip"])
def test_fault_detected_with_exact_reason_and_launch_point(model, clean, fault, point, reasons, optional):
    injector = fault()
    _, kv = run(model, [injector])
    assert injector.step is not None, "the fault found nothing to damage"
    assert clean[1].violations == []  # the clean twin
    v = first(kv.violations)
    assert v.step == injector.step and v.point is point and v.slot in injector.slots
    assert reasons & v.reasons == reasons and v.reasons & ~(reasons | optional) == Reason(0), v.line()
    # no false positives: every violation is at a damaged slot, in the damaged request's view (the slot after
    # swapped pages no longer continues the chain of the one before it), or where its pages moved to
    assert all(x.slot in injector.slots or injector.request_id in x.requests or x.slot in injector.followed
               for x in kv.violations)


def test_offload_copy_corruption_detected_on_load_back(model, clean):
    injector = OffloadCopyFlip(warmup_steps=0)
    _, kv = run(model, [injector])
    assert injector.step is not None and kv.stats.restored_requests > 0
    v = first(kv.violations)
    assert v.point is LaunchPoint.SWEEP and v.reasons == Reason.FINGERPRINT and v.position == 0, v.line()
    assert v.step > injector.step  # reported when the copy lands back, not before
    assert {x.slot for x in kv.violations} == {v.slot} and clean[1].violations == []


def test_untested_version_refused_unless_forced(model, monkeypatch, caplog):
    assert adapter.installed_version() == transformers.__version__
    monkeypatch.setattr(adapter, "installed_version", lambda: "5.99.0")
    expected = r"transformers 5\.99\.0 is installed.*transformers>=5\.17,<5\.25.*force=True"
    with pytest.raises(ConfigError, match=expected):
        adapter.install(model, CONFIG)
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        kv = adapter.install(model, CONFIG, force=True)
    kv.uninstall()
    assert "(forced)" in caplog.text and kv.version == "5.99.0"
    for old in ("4.57.1", "5.16.0"):
        monkeypatch.setattr(adapter, "installed_version", lambda v=old: v)
        with pytest.raises(ConfigError, match=f"transformers {old} is installed"):
            adapter.install(model, CONFIG)


def test_bad_install_arguments_are_named(model):
    with pytest.raises(ConfigError, match="RECOMPUTE"):
        adapter.install(model, CanaryConfig(policy=Policy.RECOMPUTE))
    with pytest.raises(ConfigError, match="generate_batch or a ContinuousBatchingManager, got int"):
        adapter.install(3, CONFIG)
    with pytest.raises(ConfigError, match="max_ctx must be >= 1, got 0"):
        adapter.install(model, CONFIG, max_ctx=0)
    with adapter.install(model, CONFIG):
        with pytest.raises(ConfigError, match="already installed"):
            adapter.install(model, CONFIG)


def test_raise_policy_stops_generation_at_the_first_violation(model):
    injector = UsedBlockFlip()
    with adapter.install(model, CanaryConfig(policy=Policy.RAISE, sweep_interval=1)) as kv:
        kv.step_hooks.append(injector)
        out = model.generate_batch(prompts(), generation_config=generation_config(),
                                   continuous_batching_config=cb_config(), progress_bar=False)
    assert injector.step is not None and kv.error is not None and "1 KV-cache violation(s)" in kv.error
    v = first(kv.violations)
    assert (v.step, v.point, v.reasons, v.slot) == (injector.step, LaunchPoint.TAIL, Reason.FINGERPRINT,
                                                    injector.slots[0])
    assert any(getattr(o, "error", None) for o in out.values()) or len(out) < len(prompts())


def test_async_batching_is_turned_off(model, caplog):
    cb = cb_config()
    cb.use_async_batching = True
    with caplog.at_level(logging.WARNING, logger="kvcanary"), adapter.install(model, CONFIG) as kv:
        out = model.generate_batch(prompts(4), generation_config=generation_config(), continuous_batching_config=cb,
                                   progress_bar=False)
    assert "async batching off" in caplog.text and len(out) == 4 and kv.violations == []
