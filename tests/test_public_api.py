"""The public API is the package root and ``kvcanary.ops``: the exported names are pinned, each
resolves, and ``import kvcanary`` stays light."""

from __future__ import annotations

import subprocess
import sys

import kvcanary
import kvcanary.ops

ROOT_NAMES = ["Canary", "CanaryConfig", "CanaryViolation", "FingerprintMode", "ForwardBatch", "Half", "HostMirror",
              "Incident", "KVSource", "LaunchPoint", "LayoutSignature", "Overlap", "Policy",
              "PoolGeometry", "PoolKind", "Reason", "Recovery",
              "StepReport", "SweepRun", "Violation", "__version__"]
OPS_NAMES = ["HAS_TRITON", "Backend", "BoundCheck", "BoundMarks", "BoundVerify", "DeviceFlag", "DeviceState",
             "FingerprintMode", "KVSource", "Plan", "SourceSet", "Workspace",
             "build_plan", "check_forward", "check_writes", "check_writes_landed", "fingerprint",
             "gather_expected_tokens", "mark_writes", "offsets_from_lengths", "scatter_req_token_ids", "stamp",
             "verify"]


def test_exported_names_are_pinned():
    assert kvcanary.__all__ == ROOT_NAMES
    assert kvcanary.ops.__all__ == OPS_NAMES
    assert set(kvcanary._EXPORTS) | {"__version__"} == set(ROOT_NAMES)


def test_every_exported_name_resolves_to_its_defining_object():
    from kvcanary.errors import CanaryViolation
    from kvcanary.ops.scatter import scatter_req_token_ids
    from kvcanary.runtime.canary import Canary

    for name in ROOT_NAMES:
        assert getattr(kvcanary, name) is not None, name
    for name in OPS_NAMES:
        assert getattr(kvcanary.ops, name) is not None, name
    assert kvcanary.Canary is Canary and kvcanary.CanaryViolation is CanaryViolation
    assert kvcanary.ops.scatter_req_token_ids is scatter_req_token_ids
    assert kvcanary.KVSource is kvcanary.ops.KVSource
    assert "Canary" in dir(kvcanary)


def test_star_import_gives_exactly_the_documented_names():
    scope: dict = {}
    exec("from kvcanary import *", scope)
    assert sorted(k for k in scope if k != "__builtins__") == sorted(ROOT_NAMES)


def test_the_readme_documents_exactly_the_exported_names():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("`from kvcanary import "))
    documented = sorted(n.strip() for n in line.removeprefix("`from kvcanary import ").split("`")[0].split(","))
    assert documented == sorted(n for n in ROOT_NAMES if n != "__version__")
    assert all(f"`{name}`" in readme for name in ("scatter_req_token_ids", "offsets_from_lengths"))


def test_unknown_name_is_an_attribute_error():
    try:
        kvcanary.NoSuchThing  # noqa: B018
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:
        raise AssertionError("kvcanary.NoSuchThing resolved")


def test_import_is_light():
    code = ("import sys, kvcanary; heavy = [m for m in ('torch', 'fastapi', 'transformers', 'matplotlib') "
            "if m in sys.modules]; from kvcanary import Canary, ForwardBatch; import kvcanary.ops; "
            "late = [m for m in ('fastapi', 'transformers', 'matplotlib', 'prometheus_client') if m in sys.modules]; "
            "print(heavy, late)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[] []", out.stdout + out.stderr
