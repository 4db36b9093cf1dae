"""Under the raise policy the served engine fails the requests that read damaged K/V and keeps
serving the rest (a concurrent clean request delivers exactly a fault-free run's tokens, /health
stays ok, later requests are served); ``on_violation 'stop'`` keeps the fail-stop. Real HTTP
(uvicorn on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time

import httpx
import pytest
import torch
from tests.server.conftest import AUTH, serve_config, served

from kvcanary.config import Policy
from kvcanary.core.record import Half
from kvcanary.engine.engine import Engine
from kvcanary.engine.request import RequestStatus
from kvcanary.faults.base import flip_bit
from kvcanary.server.service import OnViolation, ServeConfig

CLEAN = torch.randint(0, 256, (14,), generator=torch.Generator().manual_seed(77)).tolist()
VICTIM = torch.randint(0, 256, (18,), generator=torch.Generator().manual_seed(78)).tolist()
CLEAN_TOKENS = 40


def _fault_free(config: ServeConfig) -> list[int]:
    return Engine(config.model, config.engine).generate([CLEAN], CLEAN_TOKENS)[0]


async def _wait(check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        await asyncio.sleep(0.01)
    pytest.fail(f"not within {timeout} s")


def _flip_victim(service):
    """Once the victim has produced output, flip a fingerprinted bit of its prompt slot at position
    2. Runs on the engine thread between two steps (``service.run``: a thread polling the lock
    could starve while the engine steps), so the victim is still running when its bit flips.
    Returns its Generation, or None while it has no output."""
    gen = next((g for g in service.live.values() if g.client_id == "victim"), None)
    request = service.engine.requests.get(gen.engine_id) if gen is not None else None
    if request is None or not request.output_ids:
        return None
    flip_bit(service.engine, 0, Half.K, int(request.slots[2]), 0, 1)
    return gen


async def _flip_on_the_engine_thread(service, timeout: float = 30.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        gen = await service.run(lambda: _flip_victim(service))
        if gen is not None:
            return gen
        await asyncio.sleep(0.001)
    pytest.fail(f"the victim produced no output within {timeout} s")


def _sse(lines: list[str]) -> list:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


@pytest.mark.parametrize("late", [False, True], ids=["same-step", "a-step-late"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_raise_fails_the_reader_and_serves_the_rest(stream, late, as_on_cuda, caplog):
    caplog.set_level(logging.ERROR, logger="kvcanary.server")
    config = serve_config(Policy.RAISE)
    want = _fault_free(config)
    if late:  # reports read a step late, as on CUDA: the victim's tokens of the damaged step are held back
        as_on_cuda()
    with served(config) as (base, app):
        service = app.state.service
        assert service.engine.delivery.lag == int(late)

        async def main():
            async with httpx.AsyncClient(base_url=base, timeout=60) as c:
                body = {"prompt": VICTIM, "max_tokens": 400, "stream": stream}
                victim = asyncio.create_task(c.post("/v1/completions", json=body, headers={"X-Request-Id": "victim"}))
                clean = asyncio.create_task(c.post("/v1/completions", json={"prompt": CLEAN,
                                                                            "max_tokens": CLEAN_TOKENS}))
                gen = await _flip_on_the_engine_thread(service)
                return gen, await victim, await clean

        gen, victim, clean = asyncio.run(main())
        assert service.error is None
        assert clean.status_code == 200 and clean.json()["choices"][0]["token_ids"] == want
        if stream:
            assert victim.status_code == 200
            events = _sse(victim.text.splitlines())
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert all("error" not in json.loads(e) for e in events[:-2])  # the tokens before the damage
        else:
            assert victim.status_code == 500
            assert set(victim.json()) == {"error"}
            error = victim.json()["error"]
        assert error["code"] == 500 and error["type"] == "server_error"
        assert "fingerprint at TAIL" in error["message"] and "raise policy" in error["message"]
        assert gen.engine_id not in service.engine.requests and gen.engine_id not in service.live
        lines = [r.getMessage() for r in caplog.records if "failed under the raise policy" in r.getMessage()]
        assert len(lines) == 1 and lines[0].startswith("kv_canary server: request(s) victim failed"), lines
        assert service.history[-2]["status"] == "failed" or service.history[-1]["status"] == "failed"
        health = httpx.get(f"{base}/health")
        assert (health.status_code, health.json()) == (200, {"status": "ok"})
        again = httpx.post(f"{base}/v1/completions", json={"prompt": CLEAN, "max_tokens": CLEAN_TOKENS}, timeout=60)
        assert again.status_code == 200 and again.json()["choices"][0]["token_ids"] == want
        metrics = httpx.get(f"{base}/metrics").text
        assert 'kvcanary_request_success_total{finished_reason="error"} 1.0' in metrics
        page = service.engine.config.page_size
        assert service.engine.pool.num_quarantined_slots == service.engine.stats.num_quarantined_slots == page
        assert f"kvcanary_quarantined_slots_total {float(page)}" in metrics
        with service.lock:
            service.engine.check_integrity()
        assert not any(r.status is RequestStatus.FAILED for r in service.engine.requests.values())


def test_on_violation_stop_keeps_the_fail_stop():
    config = dataclasses.replace(serve_config(Policy.RAISE), on_violation=OnViolation.STOP)
    with served(config) as (base, app):
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "warm up", "max_tokens": 4}).status_code == 200
        assert httpx.post(f"{base}/canary/faults/used_slot_flip", headers=AUTH, json={}).status_code == 200
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "read the flip", "max_tokens": 8}, timeout=60)
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "the engine stopped" in message and "fingerprint at TAIL" in message and "'stop'" in message
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and health.json()["status"] == "stopped"
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "again", "max_tokens": 2})
        assert r.status_code == 503 and "the engine stopped" in r.json()["error"]["message"]
        assert httpx.get(f"{base}/canary/status").json()["engine"]["on_violation"] == "stop"
        # the damaged slot was quarantined before the engine stopped
        page = app.state.service.engine.config.page_size
        assert f"kvcanary_quarantined_slots_total {float(page)}" in httpx.get(f"{base}/metrics").text


def test_on_violation_is_checked():
    with pytest.raises(ValueError, match="on_violation 'stop' acts under the raise policy only, got policy 'log'"):
        dataclasses.replace(serve_config(Policy.LOG), on_violation=OnViolation.STOP)
    with pytest.raises(ValueError, match="on_violation must be one of 'fail-requests', 'stop', got 'halt'"):
        dataclasses.replace(serve_config(Policy.RAISE), on_violation="halt")
    assert dataclasses.replace(serve_config(Policy.RAISE), on_violation="stop").on_violation is OnViolation.STOP
