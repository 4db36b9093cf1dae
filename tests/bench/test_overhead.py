"""The overhead study at tiny shapes on the CPU: clean timed steps, tripwires caught, numbers consistent."""

from __future__ import annotations

import pytest
import torch

from kvcanary.bench.floors import MODEL_8B, StepShape
from kvcanary.bench.overhead import MODES, Pool, Step, measure, run_overhead, tripwire
from kvcanary.config import CanaryConfig, Policy
from kvcanary.runtime.canary import Canary, PoolGeometry

SHAPE = StepShape.decode(3, 40)
ROW_KEYS = {"shape", "mode", "canary_us", "per_step_us", "floor_us", "pct", "reference_pct", "violations",
            "tripwire", "timing", "checked_per_step", "stamped_per_step"}


@pytest.fixture(scope="module")
def study():
    return run_overhead(torch.device("cpu"), quick=True, seed=3, shapes=(SHAPE, StepShape.prefill(50, 2)),
                        modes=("identity", "partial", "sweep8", "truth"))


def test_every_cell_is_clean_and_its_tripwire_is_caught(study):
    rows = study["rows"]
    assert study["passed"] and not study["errors"] and len(rows) == 8
    for r in rows:
        assert ROW_KEYS <= r.keys() and r["violations"] == 0 and r["fill_violations"] == 0
    decode = {r["mode"]: r for r in rows if r["shape"] == SHAPE.label}
    assert decode["identity"]["tripwire"].startswith("detected (chain")
    for mode in ("partial", "sweep8", "truth"):
        assert decode[mode]["tripwire"].startswith("detected (fingerprint")
    assert all(r["tripwire"] == "n/a (reads no prefix)" for r in rows if r["shape"].startswith("prefill"))


def test_the_timed_step_does_the_expected_work(study):
    for r in study["rows"]:
        assert r["checked_per_step"] == r["expected_checked_per_step"]
        assert r["stamped_per_step"] == r["expected_stamped_per_step"]
    decode = next(r for r in study["rows"] if r["shape"] == SHAPE.label)
    assert decode["expected_checked_per_step"] == 2 * 3 * 40 and decode["expected_stamped_per_step"] == 3


def test_figures_are_consistent(study):
    copy = study["bandwidth_GBps"]["copy"]
    assert copy > 0 and study["meta"]["covered_layers"] == [0, 31] and study["meta"]["kv_sources"] == 4
    for r in study["rows"]:
        shape = SHAPE if r["shape"] == SHAPE.label else StepShape.prefill(50, 2)
        assert r["floor_us"] == pytest.approx(shape.floor_us(MODEL_8B, copy))
        assert r["pct"] == pytest.approx(100 * r["per_step_us"] / r["floor_us"])
        assert "target" not in r  # targets are marked on CUDA only
        assert r["timing"]["mode"].startswith("eager, perf_counter")
    sweep = next(r for r in study["rows"] if r["mode"] == "sweep8")
    assert sweep["sweep_entries"] > 0 and sweep["sweep_interval"] == 8
    assert sweep["per_step_us"] == pytest.approx(sweep["canary_us"] + sweep["sweep_us"] / 8)


def test_a_repointed_page_table_entry_is_reported_in_the_timed_step():
    """Dirty twin: the fill stamps the true table, the timed step reads one entry repointed to
    another request's slot at the same position: a chain violation at HEAD."""
    gen = torch.Generator().manual_seed(5)
    pool = Pool(MODEL_8B, SHAPE.slots + 200, (0,), torch.device("cpu"), gen)
    step = Step(pool, SHAPE, 100)
    bad = step.table.clone()
    bad[1, 7] = step.table[2, 7]
    step.step = dict(step.step, req_to_token=bad)
    row = measure(step, MODES[0], 1000.0, 1 << 20, batches=1)
    assert row["violations"] > 0 and row["fill_violations"] == 0
    assert row["first_violations"][0].startswith("HEAD chain slot=")


def test_a_tripwire_on_a_canary_that_checks_nothing_says_missed():
    gen = torch.Generator().manual_seed(6)
    pool = Pool(MODEL_8B, SHAPE.slots + 200, (0,), torch.device("cpu"), gen)
    step = Step(pool, SHAPE, 100)
    off = Canary(CanaryConfig(policy=Policy.OFF), PoolGeometry(pool.num_slots, step.rows, step.max_ctx),
                 sources=pool.sources)
    assert tripwire(off, step, step.batch("step", False), MODES[0]).startswith("MISSED (chain")


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="must be among"):
        run_overhead(torch.device("cpu"), quick=True, modes=("identity", "fast"))
