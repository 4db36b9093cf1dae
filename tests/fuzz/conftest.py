"""Print the fuzz counts (cases, outcomes by error type, problems) at the end of the session."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter):
    from .test_fuzz import COUNTS

    if not COUNTS:
        return
    terminalreporter.write_sep("-", "fuzz counts (cases by op and outcome)")
    for op in dict.fromkeys(o for o, _ in COUNTS):
        row = {kind: v for (o, kind), v in sorted(COUNTS.items()) if o == op}
        terminalreporter.write_line(f"{op}: {sum(v for k, v in row.items() if k != 'problem')} cases {row}")
