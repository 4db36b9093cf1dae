"""``kv-canary serve``: the reference engine behind an OpenAI-compatible API, with the canary's
admin routes and Prometheus metrics mounted."""

from __future__ import annotations

import logging
import os
import sys
from typing import Annotated

import typer

from kvcanary.cli import options as opt
from kvcanary.cli._app import app, err_console, options_checked, require_extra, setup_logging

SERVE = opt.Defaults()  # the defaults of the options below that every command shares
OnViolation = Annotated[str, typer.Option("--on-violation", metavar="<fail-requests|stop>",
                                          help="Under --policy raise: fail-requests ends the requests that read the "
                                               "damage with an error and keeps serving the rest; stop stops the "
                                               "engine (every later request 503 until a restart).")]


def _check_exposure(host: str, refused: bool) -> None:
    if refused:
        raise typer.BadParameter(f"binding {host} (beyond loopback) without --admin-token would let anyone who "
                                 "reaches it read cached content and change state; set --admin-token (or "
                                 "KVCANARY_ADMIN_TOKEN), or pass --allow-no-token to accept that", param_hint="--host")


def _check_on_violation(on_violation: str, policy: opt.PolicyChoice) -> None:
    if on_violation not in ("fail-requests", "stop"):
        raise typer.BadParameter(f"must be fail-requests or stop, got {on_violation!r}", param_hint="--on-violation")
    if on_violation == "stop" and policy is not opt.PolicyChoice.RAISE:
        raise typer.BadParameter(f"stop acts under --policy raise only, got --policy {policy.value}; pass "
                                 "--policy raise or drop --on-violation", param_hint="--on-violation")


@app.command(help="Serve the reference engine with the canary on: OpenAI-compatible POST /v1/completions and "
                  "/v1/chat/completions (streaming too), GET /v1/models and /health, the canary's admin routes "
                  "(/canary/status, /canary/violations, /canary/sweep, /canary/slots/{slot}, /canary/faults with "
                  "--enable-faults) and Prometheus /metrics. Binds to 127.0.0.1 by default; binding beyond loopback "
                  "needs --admin-token (or --allow-no-token). SIGTERM drains for --drain-timeout s, then exits 0.")
def serve(
    host: Annotated[str, typer.Option("--host", help="Address to bind (127.0.0.1: this machine only).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port to bind.")] = 8000,
    model: opt.Model = SERVE.model.value,
    device: opt.Device = SERVE.device.value,
    seed: opt.Seed = SERVE.seed,
    policy: opt.PolicyOption = SERVE.policy.value,
    on_violation: OnViolation = "fail-requests",
    real_kv: opt.RealKv = SERVE.real_kv.value,
    sweep_interval: opt.SweepInterval = SERVE.sweep_interval,
    sweep_budget: opt.SweepBudget = SERVE.sweep_budget,
    stats_period: Annotated[int, typer.Option("--stats-period", min=0, help="Steps between canary stats lines "
                                              "(0 = never).")] = 0,
    num_slots: Annotated[int, typer.Option("--num-slots", min=2, help="KV slots of the engine's pool.")] = 4096,
    max_ctx: Annotated[int, typer.Option("--max-ctx", min=2, help="Longest prompt + max_tokens.")] = 1024,
    admin_token: Annotated[str | None, typer.Option("--admin-token", envvar="KVCANARY_ADMIN_TOKEN",
                                                    help="Bearer token of the routes that change state or show "
                                                         "cached content.")] = None,
    enable_faults: Annotated[bool, typer.Option("--enable-faults", help="Serve the fault-injection routes "
                                                "(refused otherwise).")] = False,
    allow_no_token: Annotated[bool, typer.Option("--allow-no-token", help="Bind beyond loopback without "
                                                 "--admin-token (refused otherwise).")] = False,
    allowed_host: Annotated[list[str] | None, typer.Option("--allowed-host", help="Another name clients may send "
                                                           "in the Host header (repeatable).")] = None,
    max_prompts: Annotated[int, typer.Option("--max-prompts", min=1, help="Prompts in one request.")] = 16,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Largest max_tokens of a request.")] = 1024,
    max_queued: Annotated[int, typer.Option("--max-queued", min=1, help="Generations in the engine at once "
                                            "(429 beyond).")] = 1024,
    max_body: Annotated[int, typer.Option("--max-body-bytes", min=1024, help="Largest request body.")] = 1 << 20,
    request_timeout: Annotated[float, typer.Option("--request-timeout", min=0.001, help="Seconds a request may "
                                                   "take (504 and aborted after).")] = 120.0,
    drain_timeout: Annotated[float, typer.Option("--drain-timeout", min=0.001, help="Seconds SIGTERM lets "
                                                 "in-flight requests finish before aborting them (503).")] = 5.0,
    threads: opt.Threads = None,
    verbose: opt.Verbose = False,
) -> None:
    """Run the server until interrupted."""
    require_extra("fastapi", "server", "kv-canary serve")
    require_extra("uvicorn", "server", "kv-canary serve")
    from kvcanary.engine.config import EngineConfig
    from kvcanary.runs.setup import canary_config, check_device, model_config
    from kvcanary.server.access import AccessConfig, exposure_warning, is_loopback
    from kvcanary.server.admin import AdminConfig
    from kvcanary.server.app import route_list, run_server
    from kvcanary.server.service import ServeConfig, ServeLimits

    opt.set_threads(threads, model)
    setup_logging(logging.INFO if stats_period or verbose else logging.WARNING)
    exposed = not is_loopback(host)
    _check_exposure(host, exposed and admin_token is None and not allow_no_token)
    _check_on_violation(on_violation, opt.PolicyChoice(policy))
    with options_checked():
        config = ServeConfig(
            model=model_config(opt.model_preset(model), seed),
            engine=EngineConfig(num_slots=num_slots, max_ctx=max_ctx, chunk_size=64, host_tier_slots=num_slots // 2,
                                device=check_device(opt.device_name(device))),
            canary=canary_config(opt.canary_options(policy, real_kv, sweep_interval, sweep_budget,
                                                stats_period=stats_period)),
            admin=AdminConfig(token=admin_token, enable_faults=enable_faults),
            access=AccessConfig.for_bind(host, tuple(allowed_host or ()), max_body),
            limits=ServeLimits(max_prompts=max_prompts, max_tokens=max_tokens, max_queued=max_queued,
                               request_timeout_s=request_timeout, drain_s=drain_timeout),
            on_violation=on_violation)

    def announce(served) -> None:
        if exposed and admin_token is None:
            err_console.print("[yellow]warning:[/] " + exposure_warning(host, route_list(served)), highlight=False)
        faults = "enabled" if enable_faults else "disabled"
        err_console.print(f"kv-canary serve: http://{host}:{port}/v1/completions (model {config.model_name!r}); "
                          f"admin /canary/status, metrics /metrics; faults {faults}", highlight=False)

    run_server(config, host, port, announce)
    # Drained and shut down: skip the interpreter's teardown of torch and friends (1-2 s on a busy
    # box), so SIGTERM-to-exit stays within the drain period plus a fraction of a second.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
