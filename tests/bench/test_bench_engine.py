"""``benchmarks/bench_engine.py --lockstep`` on the CPU: stepping the engines in turn computes
what each engine computes alone, and its per-kind figures add up to the run's."""

from __future__ import annotations

import importlib.util
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_engine.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_engine_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("turn, model", [(1, "bench"), (3, "bench"), (1, "micro")])
def test_lockstep_runs_what_each_engine_runs_alone(bench, turn, model):
    prompts = bench.workload(512, 5, seed=7)
    alone = {}
    for m in ("off", "partial"):
        engine, _ = bench.build(m, "cpu", {}, model)
        assert engine.model_config == bench.MODELS[model]
        alone[m] = list(engine.generate(prompts, 4).values())
    engines = {m: bench.build(m, "cpu", {}, model) for m in ("partial", "off")}
    out = bench.run_lockstep(engines, prompts, 4, turn)
    assert set(out) == {"off", "partial"}
    for m, r in out.items():
        engine = engines[m][0]
        got = [engine.output_ids(i) for i in sorted(engine.requests)]
        assert got == alone[m]
        assert r["tokens"] == 5 * 4 and r["violations"] == 0
        assert r["steps"] == engine.stats.num_steps == r["eager"] and r["replayed"] == 0  # the CPU: no graphs
        assert 0 < r["eager_s"] <= r["seconds"] and r["replayed_s"] == 0 == r["graph_device_s"]
        assert r["tok_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
        canary = r["eager_canary_s"] + r["replayed_canary_s"]
        if m == "off":
            assert canary == 0 == r["canary_seconds"]
        else:
            assert 0 < canary <= r["canary_seconds"] and r["canary_seconds"] < r["seconds"]
    assert out["off"]["steps"] == out["partial"]["steps"]


@pytest.mark.parametrize("args, message", [
    (["--lockstep", "-1"], "--lockstep takes a number of steps >= 1, got -1"),
    (["--lockstep", "2", "--fresh-engines"], "it does not take --fresh-engines"),
])
def test_lockstep_arguments_checked(args, message):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and message in proc.stderr


def test_a_mode_sweeps_at_its_interval(bench):
    """``kind[/whole][@N]``: N steps between sweeps (0: none), 8 without; the truth suffix as before."""
    n = random.Random(3).randrange(2, 6)
    prompts = bench.workload(512, 6, seed=11)
    sweeps = {}
    for mode in ("partial", f"partial@{n}", "partial@0", f"none/whole@{n}"):
        engine, hooks = bench.build(mode, "cpu", {}, "micro")
        assert hooks.canary.config.sweep_interval == (8 if "@" not in mode else int(mode.split("@")[1]))
        assert engine.config.truth_appends is (False if "whole" in mode else None)  # None: the default, appends
        engine.generate(prompts, 20)
        steps = engine.stats.num_steps
        sweeps[mode] = hooks.canary.totals.sweeps
        every = hooks.canary.config.sweep_interval
        assert sweeps[mode] == (0 if every == 0 else len(range(0, steps, every))), (mode, steps)
    assert sweeps[f"partial@{n}"] > sweeps["partial"] > sweeps["partial@0"] == 0


def test_a_readback_mode_reads_its_widths_back(bench, monkeypatch):
    """``/readback``: every eager forward's layout reads its widths back from the batch (``max_len``
    None); without it none does; suffixes combine, and the tokens are the same either way."""
    from kvcanary.engine.attention import AttentionLayout

    from_batch, widths = AttentionLayout.from_batch.__func__, []

    def spy(cls, batch, window=0, lut=None, max_len=None, max_extend=1):
        widths.append(max_len)
        return from_batch(cls, batch, window, lut, max_len, max_extend)

    monkeypatch.setattr(AttentionLayout, "from_batch", classmethod(spy))
    prompts = bench.workload(512, 5, seed=int(random.Random().randrange(1 << 16)))
    outputs = {}
    for mode in ("off", "off/readback", "partial/whole/readback@4", "partial/whole@4"):
        widths.clear()
        engine, hooks = bench.build(mode, "cpu", {}, "micro")
        assert (hooks is None) == mode.startswith("off")
        outputs[mode] = engine.generate(prompts, 12)
        readback = "readback" in mode
        assert widths and all((w is None) is readback for w in widths), (mode, widths[:8])
        if hooks is not None:
            assert hooks.canary.config.sweep_interval == 4 and engine.config.truth_appends is False
            assert hooks.canary.totals.violations == 0
    assert all(out == outputs["off"] for out in outputs.values())


def test_a_late_mode_builds_its_sweeps_runs_at_the_sweep_and_delivers_after_the_sampling(bench, monkeypatch):
    """``/late``: the hooks build no sweep's runs ahead (``prefetch_sweeps`` off) and the engine
    delivers after the sampling (``early_delivery`` off), where the default mode builds them after
    each replayed forward before a sweep (every forward taken for a replay here, on the CPU); the
    tokens are the same either way."""
    from kvcanary.engine.canary_hooks import CanaryHooks

    before = CanaryHooks.before_forward

    def replayed(self, batch):
        self.engine.replaying = True
        before(self, batch)
    monkeypatch.setattr(CanaryHooks, "before_forward", replayed)
    prompts = bench.workload(512, 6, seed=int(random.Random().randrange(1 << 16)))
    outputs, prefetched = {}, {}
    for mode in ("partial@4", "partial/late@4", "none/whole/late"):
        engine, hooks = bench.build(mode, "cpu", {}, "micro")
        assert hooks.prefetch_sweeps is engine.early_delivery is ("late" not in mode)
        calls = []
        prefetch = hooks.canary.prefetch_sweep
        hooks.canary.prefetch_sweep = lambda runs, calls=calls, prefetch=prefetch: calls.append(1) or prefetch(runs)
        outputs[mode] = engine.generate(prompts, 12)
        prefetched[mode] = len(calls)
        assert hooks.canary.totals.violations == 0 and hooks.canary.totals.sweeps > 0
    assert prefetched["partial@4"] > 0 and prefetched["partial/late@4"] == prefetched["none/whole/late"] == 0
    assert outputs["partial@4"] == outputs["partial/late@4"] == outputs["none/whole/late"]


def test_a_graphs_mode_asks_the_canary_for_eager_graphs(bench):
    """``/graphs``: ``CanaryConfig.eager_graphs`` (which takes effect on CUDA); the other modes leave it off."""
    for mode, graphs in (("partial", False), ("partial/graphs", True), ("none/whole/graphs@4", True)):
        _, hooks = bench.build(mode, "cpu", {}, "micro")
        assert hooks.canary.config.eager_graphs is graphs and hooks.canary.route.eager is None


@pytest.mark.parametrize("mode, message", [
    ("off@4", "mode 'off@4': @ takes a sweep interval >= 0"),
    ("partial@-1", "mode 'partial@-1': @ takes a sweep interval >= 0"),
    ("partial/all", "a suffix after / is whole (token truth as whole histories), readback"),
    ("off/late", "mode 'off/late': /late is a canary mode's"),
    ("off/graphs", "mode 'off/graphs': /graphs is a canary mode's"),
    ("none/whole/whole", "each at most once, got 'whole'"),
    ("nonx", "the kind must be one of off, none, partial, all, got 'nonx'"),
])
def test_a_bad_mode_is_named(mode, message):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--modes", mode], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr


@pytest.mark.parametrize("modes", [("off", "none"), ("off", "off/readback", "none/readback")])
def test_by_kind_prints_what_the_canary_time_leaves_of_the_difference(bench, capsys, modes):
    """The "not canary" column: the median over repeats of (µs a step - the off engine's - the
    canary's own µs a step), per step kind; the wait for the device after the step, and its
    difference from the off engine's; the other columns as before. A /readback mode's off engine
    is off/readback where that runs."""
    rng = random.Random(5)
    runs = []
    for k in range(5):
        for m in modes:
            n_eager, n_replayed = rng.randrange(50, 150), rng.randrange(100, 400)
            canary = not m.startswith("off")
            runs.append({"mode": m, "repeat": k, "eager": n_eager, "replayed": n_replayed,
                         "eager_s": n_eager * rng.uniform(3e-3, 4e-3),
                         "replayed_s": n_replayed * rng.uniform(1e-3, 2e-3),
                         "eager_canary_s": n_eager * rng.uniform(1e-4, 3e-4) if canary else 0.0,
                         "replayed_canary_s": n_replayed * rng.uniform(2e-5, 6e-5) if canary else 0.0,
                         "graph_device_s": n_replayed * rng.uniform(5e-4, 6e-4),
                         "eager_wait_s": n_eager * rng.uniform(1e-6, 5e-5),
                         "replayed_wait_s": n_replayed * rng.uniform(1e-4, 5e-4)})
    bench.by_kind(runs, list(modes))
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in capsys.readouterr().out.splitlines()[1:]}
    off = {r["repeat"]: r for r in runs if r["mode"] == modes[-2]}
    on = modes[-1]
    for kind in ("eager", "replayed"):
        per = [(1e6 * r[kind + "_s"] / r[kind], 1e6 * off[r["repeat"]][kind + "_s"] / off[r["repeat"]][kind],
                1e6 * r[kind + "_canary_s"] / r[kind], 1e6 * r[kind + "_wait_s"] / r[kind],
                1e6 * off[r["repeat"]][kind + "_wait_s"] / off[r["repeat"]][kind]) for r in runs if r["mode"] == on]
        steps, step, more, canary, rest, wait, more_wait = (float(x) for x in rows[on, kind][:7])
        assert wait == pytest.approx(statistics.median(p[3] for p in per), abs=0.05)
        assert more_wait == pytest.approx(statistics.median(p[3] - p[4] for p in per), abs=0.05)
        assert step == pytest.approx(statistics.median(p[0] for p in per), abs=0.05)
        assert more == pytest.approx(statistics.median(p[0] - p[1] for p in per), abs=0.05)
        assert canary == pytest.approx(statistics.median(p[2] for p in per), abs=0.05)
        assert rest == pytest.approx(statistics.median(p[0] - p[1] - p[2] for p in per), abs=0.05)
        assert [float(x) for x in rows[modes[-2], kind][2:5]] == [0.0, 0.0, 0.0]


def test_a_readback_modes_on_off_is_against_off_readback(tmp_path):
    """The summary's on/off of a /readback mode pairs it with off/readback (each repeat's pair),
    of any other mode with off; the JSON names the pairing."""
    out = tmp_path / "run.json"
    modes = ["off/readback", "partial/readback", "partial"]
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--model", "micro", "--requests", "4",
                           "--max-new-tokens", "6", "--repeats", "2", "--lockstep", "--modes", ",".join(modes),
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    tps = {(r["mode"], r["repeat"]): r["tok_per_s"] for r in data["runs"]}
    want = {"off": "off", "off/readback": "off/readback", "partial/readback": "off/readback", "partial": "off"}
    for s in data["summary"]:
        assert s["against"] == want[s["mode"]]
        ratios = [tps[s["mode"], k] / tps[s["against"], k] for k in range(2)]
        assert s["ratio"] == pytest.approx(statistics.median(ratios))


def test_off_named_among_the_modes_runs_and_reports_once(tmp_path):
    """``--modes off,partial`` (off named, as it always runs): one off engine, one off line in the
    summary and one off run a repeat, as with ``--modes partial``."""
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--model", "micro", "--requests", "4",
                           "--max-new-tokens", "4", "--repeats", "2", "--lockstep", "--modes", "off,partial",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert [s["mode"] for s in data["summary"]] == ["off", "partial"]
    assert sorted((r["mode"], r["repeat"]) for r in data["runs"]) == [("off", 0), ("off", 1), ("partial", 0),
                                                                       ("partial", 1)]
