"""``kv-canary run``, start to end: options -> setup -> the kind of run -> its report.

| options                  | kind of run                         | file                 |
|--------------------------|-------------------------------------|----------------------|
| (default)                | one reference engine                | ``runs/single.py``   |
| ``pd=True``              | a prefill/decode split of two       | ``runs/pd.py``       |
| ``tp=N``                 | N tensor-parallel ranks             | ``runs/tp.py``       |
| ``engine=TRANSFORMERS``  | transformers continuous batching    | ``runs/transformers.py`` |

Every kind drives the workload with ``runs.driver`` and reports a ``runs.report.RunReport``.
Faults are built (``faults.judge.select_faults``) only when ``options.faults`` names some, so a
clean run imports no fault code.
"""

from __future__ import annotations

from kvcanary.runs.driver import Progress
from kvcanary.runs.pd import run_pd
from kvcanary.runs.report import RunReport
from kvcanary.runs.setup import EngineKind, OptionError, RunOptions, RunSetup, run_setup
from kvcanary.runs.single import run_single
from kvcanary.runs.tp import run_tp
from kvcanary.runs.transformers import run_transformers


def build_faults(options: RunOptions, setup: RunSetup) -> list:
    """The faults ``options`` names, refused (``OptionError``) where they could never act."""
    if not options.faults:
        return []
    from kvcanary.faults.judge import select_faults  # fault code only for a run with faults

    try:
        return select_faults(options.faults, options.seed, options.fault_warmup, pd=options.pd,
                             window=bool(setup.model.window_layers))
    except ValueError as e:  # an unknown fault, or one that needs another mode (FaultModeError)
        raise OptionError(str(e), "--fault") from None


def run(options: RunOptions, progress: Progress | None = None) -> RunReport:
    """Run what ``options`` asks for and return its report. Raises ``OptionError`` (a bad or
    unsatisfiable option, before anything runs) and ``MissingExtra``."""
    setup = run_setup(options)
    if options.engine is EngineKind.TRANSFORMERS:
        if options.faults:
            raise OptionError("--fault drives the reference engine's hooks; with --engine transformers the fault "
                              "matrix is the adapter's test suite (tests/adapters)", "--fault")
        return run_transformers(setup, (), progress)
    faults = build_faults(options, setup)
    if options.tp > 1:
        return run_tp(setup, options.tp, faults, progress)
    if options.pd:
        return run_pd(setup, faults, progress)
    return run_single(setup, faults, progress)
