"""A server runs for months: what it keeps per request or per token is dropped once the request
has left, whichever way it left (finished, stopped at a stop string, failed under raise)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from kvcanary.config import CanaryConfig, Policy
from kvcanary.engine.config import EngineConfig
from kvcanary.server.admin import AdminConfig
from kvcanary.server.app import build_app
from kvcanary.server.service import ServeConfig, ServeLimits

TOKEN = "t0ken-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_nothing_grows_with_the_requests_served():
    config = ServeConfig(engine=EngineConfig(num_slots=512, max_ctx=256, chunk_size=32, host_tier_slots=256),
                         canary=CanaryConfig(policy=Policy.RAISE, sweep_interval=4),
                         admin=AdminConfig(token=TOKEN, enable_faults=True), limits=ServeLimits(history=4))
    with TestClient(build_app(config), base_url="http://127.0.0.1:8000") as c:
        service = c.app.state.service
        statuses = []
        for i in range(10):
            if i == 5:
                assert c.post("/canary/faults/used_slot_flip", headers=AUTH, json={}).status_code == 200
            body = {"prompt": [f"request {i}", f"and its twin {i}"], "max_tokens": 12}
            if i % 3 == 0:
                body["stop"] = " "
            statuses.append(c.post("/v1/completions", json=body).status_code)
        assert statuses.count(500) == 1 and statuses.count(200) == 9, statuses
        delivery = service.engine.delivery
        assert (service.engine.requests, service.live, delivery.log, delivery._count, delivery._pending) == (
            {}, {}, [], {}, {})
        assert len(service.names) == len(service.history) == 4
        assert {h["status"] for h in service.history} <= {"finished", "failed"}
