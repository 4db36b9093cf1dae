"""The command line's edges: a clean run loads no fault code; a missing extra is one line naming
it; a fault that cannot act in the chosen mode, or prompts longer than the context, are refused
before anything runs, naming what to change; ``--version``."""

from __future__ import annotations

import json
import re
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


# --- the command line as people expect it -------------------------------------------------------

COMMANDS = ("run", "demo", "soak", "serve", "bench", "report")
# runs the CLI in a fresh interpreter, then prints which heavy modules its parsing imported
LIGHT_PROBE = """
import sys
sys.argv = ["kv-canary", *sys.argv[1:]]
from kvcanary.cli import main
try:
    main()
except SystemExit as e:
    code = e.code
print("HEAVY", sorted(m for m in ("torch", "numpy", "numba", "triton") if m in sys.modules))
sys.exit(code)
"""


def light_probe(*args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    out = subprocess.run([sys.executable, "-c", LIGHT_PROBE, *args], capture_output=True, text=True, timeout=120)
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("HEAVY")]
    return out, json.loads(line.removeprefix("HEAVY ").replace("'", '"'))


@pytest.mark.parametrize("command", [(), *((c,) for c in COMMANDS)], ids=["top", *COMMANDS])
def test_dash_h_is_help(command):
    short, long = invoke(*command, "-h"), invoke(*command, "--help")
    assert short.exit_code == 0 and long.exit_code == 0, short.output
    assert short.output == long.output and "Usage: " in short.output
    assert re.search(r"--help\s+-h|-h, --help", short.output), short.output


@pytest.mark.parametrize("args", [("--help",), ("run", "--help"), ("demo", "-h"), ("bench", "-h"),
                                  ("run", "--policy", "sometimes")], ids=["top", "run", "demo", "bench", "bad-option"])
def test_help_and_bad_options_import_no_torch(args):
    out, heavy = light_probe(*args)
    assert out.returncode == (2 if "sometimes" in args else 0), out.stderr
    assert heavy == [], f"parsing {args} imported {heavy}"


def test_a_run_imports_torch():  # the twin: the probe sees torch when a command really runs
    out, heavy = light_probe("run", *SMALL)
    assert out.returncode == 0, out.stderr
    assert "torch" in heavy


@pytest.mark.parametrize("where", ["before", "after"])
def test_log_json_before_or_after_the_command(where):
    args = ["run", *SMALL, "--fault", "used_slot_flip", "--fault-warmup", "1"]
    result = invoke(*(["--log-json", *args] if where == "before" else [*args, "--log-json"]))
    assert result.exit_code == 1, result.output  # the fault was detected
    lines = [json.loads(x) for x in result.stderr.splitlines() if x.startswith("{")]
    assert [x["fields"]["reason"] for x in lines if x.get("event") == "violation"] == ["fingerprint"]


def test_version_after_the_command():
    result = invoke("run", "--version")
    assert result.exit_code == 0 and result.output.strip() == f"kv-canary {__version__}"


def test_a_global_flag_after_double_dash_is_not_moved():
    result = invoke("report", "--", "--log-json")  # a file named --log-json, which does not exist
    assert result.exit_code == 2 and "--log-json" in result.output and "does not exist" in result.output


@pytest.mark.parametrize("option, value, choices", [
    ("--policy", "sometimes", "off, log, raise, recompute"),
    ("--real-kv", "some", "none, partial, all"),
    ("--model", "huge", "tiny, small, hybrid-swa"),
    ("--device", "tpu", "cpu, cuda"),
    ("--engine", "vllm", "reference, transformers"),
])
def test_a_bad_choice_is_one_plain_sentence(option, value, choices):
    result = invoke("run", option, value)
    assert result.exit_code == 2
    text = " ".join(result.output.replace("│", " ").split())
    assert f"Invalid value for '{option}': '{value}' is not one of {choices}" in text, text
    assert "Value error" not in text and "Input should be" not in text


@pytest.mark.parametrize("args, words", [
    (("run", "--requests", "abc"), "Invalid value for '--requests': expected a whole number, got 'abc'"),
    (("run", "--requests=0"), "Invalid value for '--requests': expected at least 1, got '0'"),
    (("serve", "--port", "99999"), "Invalid value for '--port': expected at most 65535, got '99999'"),
    (("bench", "nope"), "Invalid value for 'what': 'nope' is not one of ops, overhead, step, all"),
])
def test_a_bad_number_or_argument_is_said_plainly(args, words):
    result = invoke(*args)
    assert result.exit_code == 2
    text = " ".join(result.output.replace("│", " ").split())
    assert words in text, text
    assert "Input should" not in text and "Value error" not in text


def test_plain_words_leave_plain_messages_alone():
    from kvcanary.cli._app import plain_words

    message = "unknown fault(s) nope; choose from a, b"
    assert plain_words(message, "nope") == message
    assert plain_words("Input should be a valid boolean", "maybe") == "expected a valid boolean, got 'maybe'"


def test_choices_are_case_blind_and_reach_the_run(tmp_path):
    path = tmp_path / "r.json"
    result = invoke("run", *SMALL, "--policy", "RAISE", "--real-kv", "All", "--report", str(path))
    assert result.exit_code == 0, result.output
    config = json.loads(path.read_text())["config"]
    assert config["policy"] == "raise" and config["real_kv"] == "all"


def test_faults_take_a_comma_list_and_the_singular_alias():
    result = invoke("run", *SMALL, "--faults", "used_slot_flip,no_such_fault")
    assert result.exit_code == 2 and "no_such_fault" in result.output
    result = invoke("run", *SMALL, "--fault", "used_slot_flip", "--fault", "no_such_fault")
    assert result.exit_code == 2 and "no_such_fault" in result.output
    result = invoke("demo", "--fault", "no_such_fault")
    assert result.exit_code == 2 and "unknown fault(s) no_such_fault" in result.output


def test_bench_help_lists_every_part():
    text = " ".join(invoke("bench", "--help").output.replace("│", " ").split())
    assert "<ops|overhead|step|all>" in text and "ops, overhead, step, or all" in text


@pytest.mark.parametrize("command", COMMANDS)
def test_help_metavars_use_angle_brackets(command):
    text = invoke(command, "--help").output
    # an option's value placeholder: "--name <...>", never "--name [a|b]" or "--name TEXT"
    placeholders = re.findall(r"--[a-z-]+(?:, --[a-z-]+)? +(\S+)", text)
    assert placeholders, text
    odd = [p for p in placeholders if p[0] in "[{" or re.fullmatch(r"[A-Z_]+", p)]
    assert not odd, odd


def test_the_cli_defaults_are_the_frozen_options():
    from kvcanary.cli import options as opt
    from kvcanary.config import Policy
    from kvcanary.ops.fingerprint import FingerprintMode
    from kvcanary.runs.setup import DemoOptions, DeviceName, EngineKind, ModelPreset, RunOptions, SoakOptions

    def as_cli(run: RunOptions) -> opt.Defaults:
        c = run.canary
        return opt.Defaults(requests=run.requests, max_new_tokens=run.max_new_tokens, seed=run.seed,
                            model=opt.ModelChoice(run.model.value), device=opt.DeviceChoice(run.device.value),
                            policy=opt.PolicyChoice(c.policy.value), real_kv=opt.RealKvChoice[c.real_kv.name],
                            sweep_interval=c.sweep_interval, sweep_budget=c.sweep_budget, truth=c.truth,
                            stats_period=c.stats_period, fault_warmup=run.fault_warmup,
                            engine=opt.EngineChoice(run.engine.value), tp=run.tp, pd=run.pd)

    assert as_cli(RunOptions()) == opt.RUN
    demo = DemoOptions()
    assert as_cli(demo.run) == opt.DEMO
    assert (demo.zoo_requests, demo.pd_warmup) == (opt.DEMO_ZOO_REQUESTS, opt.DEMO_PD_WARMUP)
    soak = SoakOptions()
    assert soak.tokens == opt.SOAK_TOKENS
    assert as_cli(RunOptions(seed=soak.seed, model=soak.model, device=soak.device, canary=soak.canary)) == opt.SOAK
    for cli, domain in ((opt.PolicyChoice, Policy), (opt.ModelChoice, ModelPreset), (opt.DeviceChoice, DeviceName),
                        (opt.EngineChoice, EngineKind)):
        assert [m.value for m in cli] == [m.value for m in domain], cli
    assert [m.name for m in opt.RealKvChoice] == [m.name for m in FingerprintMode]


def test_cold_kernel_cache_prints_one_notice(monkeypatch, tmp_path, capsys):
    import numba

    from kvcanary.ops import _cpu

    assert _cpu.usable()  # compiled (or loaded from the cache) in this process: the cache is warm
    assert not _cpu._cache_is_cold()
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))  # an empty cache: cold
    assert _cpu._cache_is_cold()
    monkeypatch.setattr(_cpu, "_usable", None)
    monkeypatch.setattr(_cpu, "kernel", lambda name: None)  # no 15 s compile in the test
    monkeypatch.setattr(_cpu, "_warm_dispatch", lambda: None)
    capsys.readouterr()
    assert _cpu.usable() and _cpu.usable()
    assert capsys.readouterr().err.splitlines() == [
        "kv-canary: compiling the CPU kernels once for this install (about 15 s)"]
