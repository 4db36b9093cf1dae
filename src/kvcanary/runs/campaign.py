"""The self-tests of ``kv-canary demo``: campaigns of runs, each judged by ``faults.judge``.

A campaign is a clean run, then one run per case (a fault, or a real-bug zoo switch with the
workload that triggers it), each judged on what the canary reported: ``run_campaign`` (faults on
one engine), ``run_pd_campaign`` (transfer faults on a prefill/decode split, judged on the decode
side, every prefill-side violation a false positive), ``run_zoo`` (the zoo: each switch's
``ZooTracker`` turns its logged acts into injections). A host-side invariant a zoo bug breaks (an
engine ``AssertionError``) stops its run like the raise policy does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvcanary.config import CanaryConfig
from kvcanary.engine.config import Bug, ModelConfig, SamplerKind
from kvcanary.engine.workload import WorkloadConfig, builtin_workload, engine_config_for
from kvcanary.faults import FAULTS, PD_FAULTS, PENDING_FAULTS
from kvcanary.faults.judge import Verdict, judge, pending_verdict, select_faults
from kvcanary.faults.zoo_tracker import ZooTracker
from kvcanary.runs.driver import Progress
from kvcanary.runs.pd import PDOutcome, check_split, run_pd_once
from kvcanary.runs.setup import RunSetup
from kvcanary.runs.single import STOPPING, RunOutcome, run_once

ProgressFor = Callable[[str], Progress | None]  # run label -> that run's progress callback


@dataclass
class CampaignReport:
    clean_violations: int
    verdicts: list[Verdict]
    pending: list[Verdict] = field(default_factory=list)  # listed, never run, never failing

    @property
    def passed(self) -> bool:
        return self.clean_violations == 0 and all(v.detected and v.false_positives == 0 for v in self.verdicts)

    def to_json(self) -> dict:
        return {"clean_violations": self.clean_violations, "passed": self.passed,
                "faults": [v.to_json() for v in self.verdicts], "pending": [v.to_json() for v in self.pending]}


def _no_progress(label: str) -> None:
    return None


def run_campaign(setup: RunSetup, names: Sequence[str] = tuple(FAULTS), *, seed: int = 0, warmup_steps: int = 24,
                 progress: ProgressFor | None = None, pending: Sequence[str] = tuple(PENDING_FAULTS)
                 ) -> CampaignReport:
    """The clean run, then one run per fault of ``names`` on the same setup; the faults of
    ``pending`` (names in ``PENDING_FAULTS``) are listed in ``pending``."""
    unknown = [n for n in pending if n not in PENDING_FAULTS]
    if unknown:
        raise ValueError(f"unknown pending fault(s) {unknown}; choose from {sorted(PENDING_FAULTS)}")
    bar = progress or _no_progress
    faults = select_faults(names, seed, warmup_steps, window=bool(setup.model.window_layers))
    clean = run_once(setup, (), bar("clean"))
    verdicts = []
    for fault in faults:
        out = run_once(setup, [fault], bar(fault.name))
        verdicts.append(judge(fault, out.injections, out.violations))
    return CampaignReport(len(clean.violations), verdicts, [pending_verdict(PENDING_FAULTS[n]) for n in pending])


def judge_pd(fault, out: PDOutcome) -> Verdict:
    """``judge`` on the decode side; the prefill side's violations are false positives."""
    return judge(fault, out.injections, out.decode.violations, elsewhere=out.prefill.violations)


def run_pd_campaign(setup: RunSetup, names: Sequence[str] = tuple(PD_FAULTS), *, seed: int = 0,
                    warmup_steps: int = 8, progress: ProgressFor | None = None) -> CampaignReport:
    """A clean split run, then one per fault of ``names``, each judged on the decode side."""
    check_split(setup)
    bar = progress or _no_progress
    faults = select_faults(names, seed, warmup_steps, pd=True)
    clean = run_pd_once(setup, (), bar("pd clean"))
    verdicts = []
    for fault in faults:
        verdicts.append(judge_pd(fault, run_pd_once(setup, [fault], bar(f"pd {fault.name}"))))
    return CampaignReport(len(clean.prefill.violations) + len(clean.decode.violations), verdicts)


GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
# what each trigger needs beyond the built-in workload: (workload overrides, engine overrides)
RECIPES: dict[Bug, tuple[dict, dict]] = {
    Bug.PREFIX_PAGE_OFF_BY_ONE: ({"system_prompt_len": 4}, {"page_size": 4}),  # prefix hits of one page
    Bug.PARTIAL_PAGE_HIT: ({"system_prompt_len": 9}, {"page_size": 4}),  # the third page starts alike
    Bug.STALE_RADIX_NODE: ({}, {"host_tier_slots": 0}),  # eviction drops nodes
    Bug.PADDING_WRITES_LIVE_SLOT: ({}, {"graph_batch_sizes": GRAPH_BATCH_SIZES}),
    Bug.REJECTED_DRAFT_KV_CACHED: ({}, {"sampler": SamplerKind.ORACLE, "num_draft_tokens": 3}),
    # load-backs under pressure, of system prompts that come back
    Bug.LOAD_BACK_UNORDERED: ({"num_system_prompts": 6, "block_size": 2}, {"num_slots": 448, "host_tier_slots": 448}),
}


@dataclass(frozen=True)
class ZooCase:
    bug: Bug
    setup: RunSetup


def zoo_cases(model: ModelConfig, canary: CanaryConfig, workload: WorkloadConfig, device: str = "cpu",
              bugs: Sequence[Bug] = tuple(Bug)) -> list[ZooCase]:
    """One case per bug: the built-in ``workload`` and its engine config (``engine_config_for``)
    with the bug's switch on and its ``RECIPES`` entry applied (page size 4 with a system prompt
    one page long or one token past two pages, no host tier, padding to captured batch sizes,
    speculative drafts, a smaller pool)."""
    cases = []
    for bug in bugs:
        workload_overrides, engine_overrides = RECIPES.get(bug, ({}, {}))
        w = builtin_workload(dataclasses.replace(workload, **workload_overrides))
        engine = engine_config_for(w, device, bugs=frozenset({bug}), **engine_overrides)
        cases.append(ZooCase(bug, RunSetup(model, engine, canary, w)))
    return cases


def twin(case: ZooCase) -> RunSetup:
    """The case's setup with its switch off: the same workload and engine features, no bug."""
    return dataclasses.replace(case.setup, engine=dataclasses.replace(case.setup.engine, bugs=frozenset()))


ZOO_STOPPING = (*STOPPING, AssertionError)  # a broken host invariant stops a zoo run


def run_zoo_case(case: ZooCase, progress: Progress | None = None) -> tuple[Verdict, RunOutcome]:
    """Run ``case`` with its tracker and judge the outcome."""
    tracker = ZooTracker(case.bug)
    out = run_once(case.setup, [tracker], progress, stopping=ZOO_STOPPING)
    return judge(tracker, tracker.injections, out.violations), out


def run_zoo(cases: Sequence[ZooCase], progress: ProgressFor | None = None) -> list[Verdict]:
    """One judged run per case."""
    bar = progress or _no_progress
    return [run_zoo_case(case, bar(case.bug.value))[0] for case in cases]
