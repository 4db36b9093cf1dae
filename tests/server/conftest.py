"""A served reference engine on 127.0.0.1 in this process: uvicorn in a thread, real HTTP."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from kvcanary.config import CanaryConfig, Policy
from kvcanary.engine.config import EngineConfig
from kvcanary.server.admin import AdminConfig
from kvcanary.server.app import build_app
from kvcanary.server.service import ServeConfig, ServeLimits

TOKEN = "t0ken-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_config(policy: Policy = Policy.LOG, **limits) -> ServeConfig:
    return ServeConfig(engine=EngineConfig(num_slots=4096, max_ctx=1024, chunk_size=64, host_tier_slots=1024),
                       canary=CanaryConfig(policy=policy, sweep_interval=4),
                       admin=AdminConfig(token=TOKEN, enable_faults=True), limits=ServeLimits(**limits))


@contextmanager
def served(config: ServeConfig):
    """Yields (base url, app) while uvicorn serves ``build_app(config)`` on a free loopback port."""
    app = build_app(config)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    else:
        pytest.fail("the in-process server did not start within 30 s")
    try:
        yield base, app
    finally:
        server.should_exit = True
        thread.join(15)


@pytest.fixture(scope="module")
def server():
    with served(serve_config()) as s:
        yield s
