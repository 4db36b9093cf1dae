"""``kv-canary serve``: the reference engine behind an OpenAI-compatible API, with the canary's
admin routes and Prometheus metrics mounted."""

from __future__ import annotations

import ipaddress
import logging
from typing import Annotated

import typer

from kvcanary.cli import options as opt
from kvcanary.cli._app import app, err_console, options_checked, require_extra, setup_logging
from kvcanary.config import Policy
from kvcanary.engine.config import EngineConfig
from kvcanary.ops.fingerprint import FingerprintMode
from kvcanary.runs.setup import DeviceName, ModelPreset, canary_config, check_device, model_config


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@app.command(help="Serve the reference engine with the canary on: OpenAI-compatible POST /v1/completions, the "
                  "canary's admin routes (/canary/status, /canary/violations, /canary/sweep, /canary/slots/{slot}, "
                  "/canary/faults with --enable-faults) and Prometheus /metrics. Binds to 127.0.0.1 by default.")
def serve(
    host: Annotated[str, typer.Option("--host", help="Address to bind (127.0.0.1: this machine only).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port to bind.")] = 8000,
    model: opt.Model = ModelPreset.TINY,
    device: opt.Device = DeviceName.CPU,
    seed: opt.Seed = 0,
    policy: opt.PolicyOption = Policy.LOG,
    real_kv: opt.RealKv = opt.MODE_NAMES[FingerprintMode.PARTIAL],
    sweep_interval: opt.SweepInterval = 8,
    sweep_budget: opt.SweepBudget = 1 << 20,
    stats_period: Annotated[int, typer.Option("--stats-period", min=0, help="Steps between canary stats lines "
                                              "(0 = never).")] = 0,
    num_slots: Annotated[int, typer.Option("--num-slots", min=2, help="KV slots of the engine's pool.")] = 4096,
    max_ctx: Annotated[int, typer.Option("--max-ctx", min=2, help="Longest prompt + max_tokens.")] = 1024,
    admin_token: Annotated[str | None, typer.Option("--admin-token", envvar="KVCANARY_ADMIN_TOKEN",
                                                    help="Bearer token the mutating admin routes require.")] = None,
    enable_faults: Annotated[bool, typer.Option("--enable-faults", help="Serve the fault-injection routes "
                                                "(refused otherwise).")] = False,
    threads: opt.Threads = None,
    verbose: opt.Verbose = False,
) -> None:
    """Run the server until interrupted."""
    require_extra("fastapi", "server", "kv-canary serve")
    require_extra("uvicorn", "server", "kv-canary serve")
    import uvicorn

    from kvcanary.server.admin import AdminConfig
    from kvcanary.server.app import build_app
    from kvcanary.server.service import ServeConfig

    opt.set_threads(threads, model)
    setup_logging(logging.INFO if stats_period or verbose else logging.WARNING)
    with options_checked():
        config = ServeConfig(
            model=model_config(model, seed),
            engine=EngineConfig(num_slots=num_slots, max_ctx=max_ctx, chunk_size=64, host_tier_slots=num_slots // 2,
                                device=check_device(device)),
            canary=canary_config(opt.canary_options(policy, real_kv, sweep_interval, sweep_budget,
                                                stats_period=stats_period)),
            admin=AdminConfig(token=admin_token, enable_faults=enable_faults))
    if not _is_loopback(host) and admin_token is None:
        err_console.print(f"[yellow]warning:[/] binding {host} without --admin-token: anyone who reaches it can "
                          "run sweeps" + (" and inject faults" if enable_faults else ""))
    err_console.print(f"kv-canary serve: http://{host}:{port}/v1/completions (model {config.model_name!r}); admin "
                      f"/canary/status, metrics /metrics; faults {'enabled' if enable_faults else 'disabled'}",
                      highlight=False)
    uvicorn.run(build_app(config), host=host, port=port, log_level="warning")
