"""The command line's edges: a clean run loads no fault code; a missing extra is one line naming
it; a fault that cannot act in the chosen mode, or prompts longer than the context, are refused
before anything runs, naming what to change; ``--version``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvcanary import __version__
from kvcanary.cli import app
from kvcanary.runs.setup import MAX_CONTEXT

SMALL = ["--requests", "4", "--max-new-tokens", "4"]
# runs the CLI in a fresh interpreter, then prints the kvcanary.faults modules it loaded; argv[1:]:
# the modules to hide (as if not installed), then "--", then the CLI's arguments
PROBE = """
import sys
cut = sys.argv.index("--")
for name in sys.argv[1:cut]:
    sys.modules[name] = None
sys.argv = ["kv-canary", *sys.argv[cut + 1:]]
from kvcanary.cli import main
try:
    main()
except SystemExit as e:
    code = e.code
print("FAULT-MODULES", sorted(m for m in sys.modules if m.startswith("kvcanary.faults")))
sys.exit(code)
"""


def probe(*args: str, hide: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, *hide, "--", *args], capture_output=True, text=True,
                          timeout=300)


def fault_modules(out: subprocess.CompletedProcess) -> list[str]:
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("FAULT-MODULES")]
    return json.loads(line.removeprefix("FAULT-MODULES ").replace("'", '"'))


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("mode", [(), ("--pd",)], ids=["single", "pd"])
def test_a_clean_run_imports_no_fault_code(mode):
    out = probe("run", *SMALL, *mode)
    assert out.returncode == 0, out.stderr
    assert fault_modules(out) == []


def test_a_run_with_a_fault_loads_the_fault_code():  # the twin: the probe sees fault modules when they load
    out = probe("run", *SMALL, "--fault", "used_slot_flip", "--fault-warmup", "1")
    assert "kvcanary.faults.used_slot_flip" in fault_modules(out)


@pytest.mark.parametrize("args, module, extra", [
    (("run", *SMALL, "--engine", "transformers"), "transformers", "transformers"),
    (("serve", "--port", "0"), "fastapi", "server"),
])
def test_a_missing_extra_is_one_line_naming_it(args, module, extra):
    out = probe(*args, hide=(module,))
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.endswith(f"needs the {extra} extra: pip install 'kv-canary[{extra}]'"), line


@pytest.mark.parametrize("fault, needs", [("transfer_byte_flip", "add --pd"),
                                          ("sliding_window_lut", "use --model hybrid-swa")])
def test_a_fault_that_cannot_act_in_the_mode_is_refused(fault, needs):
    result = invoke("run", *SMALL, "--fault", fault)
    assert result.exit_code == 2
    assert f"fault {fault} acts on" in result.output and needs in result.output


@pytest.mark.parametrize("fault, args", [("transfer_byte_flip", ("--pd",)),
                                         ("sliding_window_lut", ("--model", "hybrid-swa"))])
def test_the_same_fault_runs_in_its_mode(fault, args):
    result = invoke("run", "--requests", "16", "--max-new-tokens", "6", "--fault", fault, "--fault-warmup", "2",
                    *args)
    assert result.exit_code in (0, 1), result.output  # it ran (1: it was detected)
    assert "acts on" not in result.output


def test_prompts_longer_than_the_context_are_refused(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [1, 2, 3], "max_new_tokens": MAX_CONTEXT}) + "\n")
    result = invoke("run", "--prompts", str(prompts))
    assert result.exit_code == 2
    assert f"asks for {MAX_CONTEXT + 3} tokens" in result.output and f"context of {MAX_CONTEXT}" in result.output


def test_prompts_within_the_context_run(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [1, 2, 3], "max_new_tokens": 5}) + "\n")
    result = invoke("run", "--prompts", str(prompts))
    assert result.exit_code == 0, result.output


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and result.output.strip() == f"kv-canary {__version__}"
