"""One FastAPI app: the reference engine's ``/v1/completions`` with the admin routes and
``/metrics`` mounted; the engine steps while the app runs (its lifespan)."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from kvcanary.server.admin import install_error_handlers
from kvcanary.server.completions import completions_router
from kvcanary.server.service import EngineService, ServeConfig


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
    return app
