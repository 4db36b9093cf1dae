"""``RankAgreement`` in one process (a gloo group of one rank): every violation row the canary
appends is signalled exactly once, across the reporter's ring resets; under log and raise the
table of step s is read at the end of step s + 1 (raise stops there), under recompute at the end
of step s itself, before sampling. Two ranks: ``test_tp.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kvcanary.config import CanaryConfig, Policy
from kvcanary.distributed import RankAgreement, RanksOutOfStep
from kvcanary.distributed.signal import ALARM_BIT, ROWS, STEP
from kvcanary.engine.config import ModelConfig
from kvcanary.engine.model import TinyLlama
from kvcanary.engine.tp import RankCanaryHooks, build_rank_engine, rank_model_config
from kvcanary.engine.workload import WorkloadConfig, builtin_workload, engine_config_for
from kvcanary.errors import CanaryViolation, ConfigError
from kvcanary.faults import PageTableRepoint
from kvcanary.faults.hooks import FaultHooks
from kvcanary.runs.driver import run_workload
from kvcanary.runtime.canary import Canary, PoolGeometry, WatchdogTimeout


def test_needs_an_initialised_group_and_a_log_canary():
    canary = Canary(CanaryConfig(policy=Policy.RAISE), PoolGeometry(16, 4, 8))
    with pytest.raises(ConfigError, match="must run Policy.LOG, got Policy.RAISE"):
        RankAgreement(canary, Policy.RAISE)
    if not dist.is_initialized():
        with pytest.raises(ConfigError, match="init_process_group"):
            RankAgreement(Canary(CanaryConfig(), PoolGeometry(16, 4, 8)), Policy.RAISE)


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class RecordingHooks(RankCanaryHooks):
    """Keeps every agreed table."""

    def __init__(self, config):
        super().__init__(config)
        self.tables = []
        self.read_at = {}  # signal step -> the step whose end_step read its table

    def _take(self, report):
        self.tables += report.tables
        self.read_at.update({s: report.step for s in report.agreed_steps})
        super()._take(report)


def run(policy: Policy, ring_capacity: int, fault: PageTableRepoint | None):
    workload = builtin_workload(WorkloadConfig(num_requests=16, max_new_tokens=8))
    hooks = RecordingHooks(CanaryConfig(policy=policy, ring_capacity=ring_capacity, sweep_interval=4))
    fault_hooks = FaultHooks(hooks, [fault] if fault else [])
    engine = build_rank_engine(ModelConfig(), engine_config_for(workload), fault_hooks)
    hooks.attach(engine)
    fault_hooks.attach(engine)
    return engine, hooks, lambda: (run_workload(engine, workload), hooks.finish())


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("ring_capacity", [4096, 3])
def test_every_violation_row_is_signalled_once(ring_capacity):
    """A repointed page-table entry left in place (log) is reported at HEAD and TAIL of every later
    step; with a 3-row ring the reporter drops rows and resets the counter again and again. The
    agreed tables must still count every row the canary appended (dropped ones included)."""
    fault = PageTableRepoint(seed=0, warmup_steps=8)
    engine, hooks, go = run(Policy.LOG, ring_capacity, fault)
    go()
    assert fault.injections
    total = hooks.canary.counters()["ring_total"]
    assert total > 3 * ring_capacity or ring_capacity > 3  # the small ring overflowed several times
    assert sum(t[0][ROWS] for t in hooks.tables) == total > 0
    first = next(i for i, t in enumerate(hooks.tables) if t[0][ROWS])
    step = fault.injections[0].step
    assert hooks.tables[first][0][STEP] == step  # the signal of the step it was found at HEAD
    assert hooks.agreement.lag == 1 and hooks.read_at[step] == step + 1  # log: read one step late
    *steps, last = sorted(hooks.read_at)
    assert all(hooks.read_at[s] == s + 1 for s in steps[:-1])  # every table one step late, the final ones at finish
    assert hooks.canary.reporter.dropped > 0 or ring_capacity > 3


@pytest.mark.usefixtures("one_rank_group")
def test_clean_run_signals_nothing():
    engine, hooks, go = run(Policy.RAISE, 4096, None)
    go()
    assert hooks.tables and all(t[0][ROWS] == 0 for t in hooks.tables)
    assert len({t[0][3] for t in hooks.tables}) == len(hooks.tables)  # one table per step (and the final one)
    assert hooks.agreement.divergences == [] and hooks.reports == []


@pytest.mark.usefixtures("one_rank_group")
def test_raise_stops_one_step_after_the_fault():
    """The table of the fault's step is read at the end of the next step, which does not complete;
    the error names the step of the signal and carries the local violations of both steps."""
    fault = PageTableRepoint(seed=0, warmup_steps=8)
    engine, hooks, go = run(Policy.RAISE, 4096, fault)
    with pytest.raises(CanaryViolation) as e:
        go()
    hooks.agreement.drain()
    step = fault.injections[0].step
    assert engine.step_index == step + 1  # the step after the fault did not complete
    assert hooks.read_at and max(hooks.read_at) == step - 1  # every table before the fault's was read clean
    assert e.value.violations and {v.step for v in e.value.violations} == {step, step + 1}
    assert min(v.step for v in e.value.violations) == step
    assert f"step {step}, rank 0 of 1: ranks [0] reported violations" in str(e.value)
    assert torch.is_tensor(hooks.canary.state.ring_counter)


@pytest.mark.usefixtures("one_rank_group")
def test_raise_twin_without_the_fault_reads_every_table_one_step_late():
    engine, hooks, go = run(Policy.RAISE, 4096, None)
    go()
    *steps, _ = sorted(hooks.read_at)
    assert len(steps) > 8 and all(hooks.read_at[s] == s + 1 for s in steps[:-1])
    assert all(t[0][ROWS] == 0 for t in hooks.tables) and hooks.reports == []


@pytest.mark.usefixtures("one_rank_group")
def test_recompute_joins_the_table_of_the_step_before_sampling():
    fault = PageTableRepoint(seed=0, warmup_steps=8)
    engine, hooks, go = run(Policy.RECOMPUTE, 4096, fault)
    go()
    step = fault.injections[0].step
    assert hooks.agreement.lag == 0
    assert all(hooks.read_at[s] == s for s in hooks.read_at if s < engine.step_index)  # read in its own step
    assert hooks.recoveries and hooks.recoveries[0][0] == step and hooks.recoveries[0][1].since_step == step


@pytest.mark.usefixtures("one_rank_group")
def test_lag_is_checked():
    canary = Canary(CanaryConfig(), PoolGeometry(64, 4, 16))
    with pytest.raises(ConfigError, match=r"lag 2 not in \(0, 1\)"):
        RankAgreement(canary, Policy.LOG, lag=2)
    with pytest.raises(ConfigError, match="lag 1 under Policy.RECOMPUTE would sample tokens of a damaged step"):
        RankAgreement(canary, Policy.RECOMPUTE, lag=1)


@pytest.mark.usefixtures("one_rank_group")
def test_ranks_out_of_step_are_refused():
    agreement = RankAgreement(Canary(CanaryConfig(), PoolGeometry(64, 4, 16)), Policy.LOG, lag=0)
    agreement.launch(5, None)
    agreement._in_flight[0].work.wait()
    agreement._tables[0][0, STEP] = 6  # as if a rank had sent its signal of step 6
    with pytest.raises(RanksOutOfStep, match=r"rank 0 agreed on step 5 but the ranks sent steps \[6\]"):
        agreement.end_step(5)


def test_shard_and_rank_shapes_refuse_heads_that_do_not_split():
    with pytest.raises(ConfigError, match=r"ModelConfig.num_heads \(4\) must be a multiple of the tensor-parallel "
                                          r"ranks \(3\)"):
        rank_model_config(ModelConfig(), 3)
    assert rank_model_config(ModelConfig(), 2) == ModelConfig(num_heads=2, num_kv_heads=1, intermediate=64)
    model = TinyLlama(ModelConfig(), 32)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        model.shard(2, 2, lambda x: x)
    with pytest.raises(ValueError, match=r"ModelConfig.intermediate \(128\) must be a multiple of num_ranks \(3\)"):
        TinyLlama(ModelConfig(num_heads=6, num_kv_heads=3), 32).shard(0, 3, lambda x: x)
    model.shard(1, 2, lambda x: x)
    full = TinyLlama(ModelConfig(), 32)
    w, f = model.layers[0], full.layers[0]
    assert torch.equal(w.wq, f.wq[32:64]) and torch.equal(w.wk, f.wk[16:32]) and torch.equal(w.wo, f.wo[:, 32:64])
    assert torch.equal(w.w_up, f.w_up[64:]) and torch.equal(w.w_down, f.w_down[:, 64:])  # rank 1: second halves


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("policy", [Policy.LOG, Policy.RAISE], ids=["log", "raise"])
def test_a_watchdog_alarm_is_signalled_with_the_next_launch_and_read_a_step_later(policy):
    """Steps without HEAD: the canary's watchdog fires at the end of some step a; the flag is
    signalled with step a + 1 and read at the end of a + 2 (raise: WatchdogTimeout there)."""
    canary = Canary(CanaryConfig(sweep_interval=0, watchdog_window=2), PoolGeometry(64, 4, 16))
    agreement = RankAgreement(canary, policy)
    alarm_step, alarms, error = None, {}, None
    try:
        for step in range(8):
            agreement.launch(step, None)
            report = agreement.end_step(step)
            alarms.update({s: t[0][1] & ALARM_BIT for s, t in zip(report.agreed_steps, report.tables, strict=True)})
            if report.alarms and alarm_step is None:
                alarm_step = step
    except WatchdogTimeout as e:
        error = (step, str(e))
    agreement.drain()
    assert alarm_step is not None
    assert [s for s, bit in alarms.items() if bit] == ([] if policy is Policy.RAISE else [alarm_step + 1])
    assert all(not bit for s, bit in alarms.items() if s != alarm_step + 1)
    if policy is Policy.RAISE:
        assert error == (alarm_step + 2, f"step {alarm_step + 1}: the canary watchdog fired on rank(s) [0]")
    else:
        assert error is None
