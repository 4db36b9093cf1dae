"""The ``kv-canary`` command line.

    kv-canary run    the built-in workload through the reference engine with the canary on;
                     summary, optional JSON report; exit 1 when a violation was reported
    kv-canary demo   self-test: a clean run, one run per fault kind, then one run per real-bug
                     zoo switch; exit 1 when a fault or bug was missed or a run reported a false
                     positive
    kv-canary soak   the reference engine clean for a token budget with every mechanism the canary
                     guards exercised; exit 1 when one was never exercised or a violation was reported
    kv-canary serve  the reference engine behind an OpenAI-compatible /v1/completions, with the
                     canary's admin routes and Prometheus /metrics (needs the server extra)
    kv-canary report a run's JSON report as a self-contained HTML incident page and a PNG timeline
    kv-canary bench  kernel microbenchmarks (ops), the overhead study (overhead) and a real
                     8B-shaped step with the canary off and on (step), each beside its floor
                     measured in the same run; table last, optional JSON

``--log-json`` (JSON log lines) and ``--version`` go before or after the command; ``-h`` is
``--help``. Parsing imports no torch (``options``), so help and bad options answer at once.

Configuration is built here, from the options, and passed down frozen.
"""

from kvcanary.cli import bench, demo, report, run, serve, soak  # noqa: F401  (each module registers its command)
from kvcanary.cli._app import app


def main() -> None:
    app()
