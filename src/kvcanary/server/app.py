"""One FastAPI app: the reference engine's OpenAI-compatible routes with the admin routes and
``/metrics`` mounted, behind the access rules (``access.py``) and the request-id middleware; the
engine thread runs while the app runs (its lifespan)."""

from __future__ import annotations

import gc
import re
import sys
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI

from kvcanary.server.access import AccessMiddleware
from kvcanary.server.completions import completions_router
from kvcanary.server.errors import error_response, install_error_handlers
from kvcanary.server.service import EngineService, ServeConfig

REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")  # fits the violation line's request field


class RequestIdMiddleware:
    """Takes the client's ``X-Request-Id`` (or makes one), keeps it in ``scope["state"]["request_id"]``
    for the routes (it names the request in violation lines and incidents) and echoes it on the
    response. An id outside ``REQUEST_ID_RE`` is refused with 400."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw = dict(scope.get("headers") or []).get(b"x-request-id")
        if raw is None:
            rid = f"cmpl-{uuid.uuid4().hex}"
        else:
            rid = raw.decode("latin-1")
            if not REQUEST_ID_RE.match(rid):
                response = error_response(400, f"X-Request-Id {rid[:80]!r} must be 1-64 characters of A-Z a-z "
                                               "0-9 . _ -", "X-Request-Id")
                return await response(scope, receive, send)
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", rid.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)


def build_app(config: ServeConfig) -> FastAPI:
    """The served reference engine. ``app.state.service`` is its ``EngineService``."""
    service = EngineService(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start()
        try:
            yield
        finally:
            service.stop()

    app = FastAPI(title="kv-canary reference engine", lifespan=lifespan)
    app.state.service = service
    install_error_handlers(app)
    app.include_router(completions_router(service))
    app.include_router(service.admin.router())
    app.add_middleware(AccessMiddleware, config=config.access)
    app.add_middleware(RequestIdMiddleware)  # added last: outermost, so refusals carry the id too
    return app


def route_list(app: FastAPI) -> list[str]:
    """``"GET /canary/status"``, ... for every route of ``app`` (the exposure warning names them)."""
    return [f"{method.upper()} {path}" for path, ops in app.openapi()["paths"].items() for method in ops]


def run_server(config: ServeConfig, host: str, port: int, announce=None) -> None:
    """Serve ``build_app(config)`` on ``host:port`` until SIGINT/SIGTERM, then drain: new requests
    get 503, in-flight ones have ``ServeLimits.drain_s`` to finish, the rest are aborted with a
    clean 503, and the process exits 0. ``announce(app)`` runs before it binds."""
    import uvicorn

    # The engine thread is busy Python between its torch calls; a 1 ms GIL switch interval (5 ms by
    # default) lets the event loop answer /metrics and the admin routes promptly under load.
    sys.setswitchinterval(0.001)
    app = build_app(config)
    if announce is not None:
        announce(app)
    gc.collect()
    gc.freeze()  # the model, pool and modules: never garbage, so full collections under load skip them
    service: EngineService = app.state.service
    drain_s = config.limits.drain_s

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # a drained shutdown exits 0 instead of re-raising the signal

        async def shutdown(self, sockets=None) -> None:
            service.begin_drain(drain_s)
            await super().shutdown(sockets)

    uv = uvicorn.Config(app, host=host, port=port, log_level="warning",
                        timeout_graceful_shutdown=int(drain_s) + 2, timeout_keep_alive=30)
    DrainingServer(uv).run()
