"""The served engine over real HTTP (uvicorn on 127.0.0.1): admin and metrics answer while
generations run, abandoned and timed-out requests are aborted in the engine, finished requests
leave it, the client's request id names its requests, streaming and chat through the real
``openai`` client, engine metrics through Prometheus' own parser, and the drain."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from tests.server.conftest import AUTH, serve_config, served

openai = pytest.importorskip("openai")


def _prompt(i: int, n: int = 12) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(1000 + i)).tolist()


def _metrics(base: str) -> dict:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}


def _wait_for(check, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"not within {timeout} s")


def test_admin_and_metrics_answer_while_generations_run(server):
    base, app = server
    service = app.state.service

    async def main():
        async with httpx.AsyncClient(base_url=base, timeout=120, limits=httpx.Limits(max_connections=80)) as c:
            long = [asyncio.create_task(c.post("/v1/completions", json={"prompt": _prompt(i), "max_tokens": 120}))
                    for i in range(40)]
            deadline = time.monotonic() + 30  # generations running (a fixed wait races a busy box)
            while not service.live and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            times = []
            for path in ("/metrics", "/canary/status", "/health", "/canary/violations") * 5:
                t0 = time.perf_counter()
                r = await c.get(path)
                times.append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text
            in_flight = len(service.live)
            results = await asyncio.gather(*long)
            return times, in_flight, results

    times, in_flight, results = asyncio.run(main())
    assert in_flight > 0, "the admin reads must have overlapped the generations"
    assert max(times) < 1.0, times  # one engine step at most (a few ms), never a generation
    assert all(r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 120 for r in results)


def test_abandoned_requests_are_aborted_in_the_engine(server):
    base, app = server
    service = app.state.service
    aborts = service.engine.stats.num_aborts

    async def abandon():
        async with httpx.AsyncClient(base_url=base, timeout=120) as c:
            tasks = [asyncio.create_task(c.post("/v1/completions", json={"prompt": _prompt(i), "max_tokens": 900}))
                     for i in range(16)]
            deadline = time.monotonic() + 30  # every request running in the engine (a fixed wait races a busy box)
            while len(service.live) < 16 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert len(service.live) >= 16, f"{len(service.live)} of 16 requests reached the engine"
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(abandon())
    _wait_for(lambda: not service.live)
    assert service.engine.stats.num_aborts - aborts == 16 and not service.engine.requests
    t0 = time.perf_counter()
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "next", "max_tokens": 8}, timeout=30)
    assert r.status_code == 200 and time.perf_counter() - t0 < 5


def test_abandoned_stream_is_aborted(server):
    base, app = server
    service = app.state.service
    with httpx.stream("POST", f"{base}/v1/completions", json={"prompt": "stream me", "max_tokens": 900,
                                                              "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    _wait_for(lambda: not service.live)
    assert not service.engine.requests


def test_timeout_answers_504_and_aborts():
    with served(serve_config(request_timeout_s=0.3)) as (base, app):
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "slow", "max_tokens": 1000}, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error", r.text
        assert "within 0.3 s" in r.json()["error"]["message"]
        _wait_for(lambda: not app.state.service.live)
        assert app.state.service.engine.stats.num_aborts == 1


def test_finished_requests_leave_the_engine_and_history_is_bounded():
    with served(serve_config(history=5)) as (base, app):
        service = app.state.service
        for i in range(8):
            r = httpx.post(f"{base}/v1/completions", json={"prompt": [_prompt(i, 5), _prompt(50 + i, 6)],
                                                           "max_tokens": 3}, headers={"X-Request-Id": f"h-{i}"})
            assert r.status_code == 200
        assert service.engine.requests == {} and service.live == {}
        assert [h["client"] for h in service.history] == ["h-5.1", "h-6.0", "h-6.1", "h-7.0", "h-7.1"]
        assert len(service.names) == 5 and set(service.names.values()) == {h["client"] for h in service.history}
        status = httpx.get(f"{base}/canary/status").json()["engine"]
        assert status["known_requests"] == 0 and status["recent_requests"][-1]["completion_tokens"] == 3


def test_queue_cap_answers_429():
    with served(serve_config(max_queued=3)) as (base, _):
        r = httpx.post(f"{base}/v1/completions", json={"prompt": ["a", "b", "c", "d"], "max_tokens": 2})
        assert r.status_code == 429 and "at most 3" in r.json()["error"]["message"]
        r = httpx.post(f"{base}/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2})
        assert r.status_code == 200


def test_request_id_is_echoed_and_names_the_request_in_violations(server, caplog):
    base, app = server
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "warm", "max_tokens": 2})
    assert r.headers["x-request-id"].startswith("cmpl-") and r.json()["id"] == r.headers["x-request-id"]
    since = httpx.get(f"{base}/canary/violations").json()["next"]
    assert httpx.post(f"{base}/canary/faults/used_slot_flip", json={"seed": 3}, headers=AUTH).status_code == 200
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "victim of a flip", "max_tokens": 8},
                       headers={"X-Request-Id": "client-42"}, timeout=30)
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-42" and r.json()["id"] == "client-42"
    rows = httpx.get(f"{base}/canary/violations", params={"since": since}, headers=AUTH).json()["violations"]
    assert rows and {o["client"] for v in rows for o in v["requests"]} == {"client-42"}
    lines = [m for m in (rec.getMessage() for rec in caplog.records) if m.startswith("kv_canary violation:")]
    assert lines and all("requests=client-42@" in line for line in lines), lines
    bad = httpx.post(f"{base}/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "has space"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"


def test_openai_client_streams_the_same_text(server):
    base, _ = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    prompt = "The canary sings: ünïcode ✓"
    whole = client.completions.create(model="kv-canary-reference", prompt=prompt, max_tokens=24)
    chunks = list(client.completions.create(model="kv-canary-reference", prompt=prompt, max_tokens=24, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].usage.prompt_tokens == len(prompt.encode())

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model="kv-canary-reference", messages=messages, max_tokens=10)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens == len(b"<|system|>\nbe brief\n<|user|>\nhello\n<|assistant|>\n")
    deltas = list(client.chat.completions.create(model="kv-canary-reference", messages=messages, max_tokens=10,
                                                 stream=True))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="kv-canary-reference", messages=[], max_tokens=2)
    assert e.value.body["param"] == "messages"


def test_greedy_outputs_are_the_same_at_every_concurrency(server):
    base, _ = server
    prompts = [_prompt(200 + i, 10 + i % 7) for i in range(24)]

    async def run(concurrency: int) -> list[list[int]]:
        sem = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            async def one(p):
                async with sem:
                    r = await c.post("/v1/completions", json={"prompt": p, "max_tokens": 12})
                    return r.json()["choices"][0]["token_ids"]
            return await asyncio.gather(*(one(p) for p in prompts))

    alone = asyncio.run(run(1))
    assert asyncio.run(run(24)) == alone and len({tuple(o) for o in alone}) > 1


def test_engine_metrics_in_the_vllm_style():
    with served(serve_config()) as (base, _):
        sizes = [(5, 3), (9, 4), (7, 6)]
        for i, (n, k) in enumerate(sizes):
            assert httpx.post(f"{base}/v1/completions", json={"prompt": _prompt(300 + i, n),
                                                              "max_tokens": k}).status_code == 200
        m = _metrics(base)
        assert m[("kvcanary_prompt_tokens_total", ())] == sum(n for n, _ in sizes)
        assert m[("kvcanary_generation_tokens_total", ())] == sum(k for _, k in sizes)
        assert m[("kvcanary_num_requests_running", ())] == 0 and m[("kvcanary_num_requests_waiting", ())] == 0
        assert m[("kvcanary_request_success_total", (("finished_reason", "length"),))] == 3
        assert m[("kvcanary_time_to_first_token_seconds_count", ())] == 3
        assert m[("kvcanary_e2e_request_latency_seconds_count", ())] == 3
        ttft = m[("kvcanary_time_to_first_token_seconds_sum", ())]
        e2e = m[("kvcanary_e2e_request_latency_seconds_sum", ())]
        assert 0 < ttft <= e2e


def test_drain_answers_in_flight_then_refuses():
    with served(serve_config(drain_s=0.5)) as (base, app):
        service = app.state.service

        async def main():
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                quick = asyncio.create_task(c.post("/v1/completions", json={"prompt": "quick", "max_tokens": 2}))
                slow = [asyncio.create_task(c.post("/v1/completions", json={"prompt": _prompt(i), "max_tokens": 1000}))
                        for i in range(8)]
                for _ in range(600):  # until all nine were received (not a fixed sleep: a loaded machine is slower)
                    if len(service.live) == 9 or (quick.done() and len(service.live) == 8):
                        break
                    await asyncio.sleep(0.01)
                service.begin_drain(0.5)
                late = await c.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
                health = await c.get("/health")
                return await quick, await asyncio.gather(*slow), late, health

        quick, slow, late, health = asyncio.run(main())
        assert quick.status_code == 200
        assert [r.status_code for r in slow] == [503] * 8 and "shutting down" in slow[0].json()["error"]["message"]
        assert late.status_code == 503 and health.status_code == 503 and health.json()["status"] == "draining"
        assert not service.live and not service.engine.requests


def set_report_lag(app, lag: int) -> None:
    """Reports read ``lag`` steps late, as on CUDA (the engine is idle: no request was sent yet)."""
    service = app.state.service
    for canary in service.canaries():
        canary.reporter.lag = lag
    service.engine.delivery.lag = lag


@pytest.mark.parametrize("lag", [0, 1], ids=["in_step", "one_step_late"])
def test_recompute_streams_only_fault_free_tokens(lag):
    """Under the recompute policy a slot flipped while streams run is caught and the readers are
    re-prefilled: every token any stream ever emitted equals the fault-free run's, in order. With
    reports one step late a token is streamed only once its step's report was read, and an idle
    engine reads the last one (no stream waits forever for its last token)."""
    from kvcanary.config import Policy

    prompts = [f"stream {i}: the canary sings of KV" for i in range(4)]

    def stream_all(base: str) -> list[str]:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)

        async def one(p: str) -> str:
            aclient = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
            chunks = await aclient.completions.create(model="kv-canary-reference", prompt=p, max_tokens=40,
                                                      stream=True)
            return "".join([c.choices[0].text async for c in chunks if c.choices])

        async def main():
            return await asyncio.gather(*(one(p) for p in prompts))

        assert client.models.list().data[0].id == "kv-canary-reference"
        return asyncio.run(main())

    with served(serve_config()) as (base, app):
        set_report_lag(app, lag)
        clean = stream_all(base)
    with served(serve_config(Policy.RECOMPUTE)) as (base, app):
        set_report_lag(app, lag)
        r = httpx.post(f"{base}/canary/faults/used_slot_flip", json={"seed": 5, "warmup_steps": 3}, headers=AUTH)
        assert r.status_code == 200, r.text
        recovered = stream_all(base)
        service = app.state.service
        injections = service.injections()
        assert injections and service.canary.totals.violations > 0 and service.canary.totals.recomputed_requests > 0
    assert recovered == clean


def test_step_reports_stay_bounded_once_the_admin_log_has_them():
    from kvcanary.core.record import LaunchPoint, LaunchTag, Reason
    from kvcanary.runtime.canary import StepReport
    from kvcanary.runtime.reporting import Violation
    from kvcanary.server.service import EngineService

    service = EngineService(serve_config())
    for step in range(600):
        v = Violation(step, LaunchTag(LaunchPoint.HEAD), Reason.CHAIN, 5, 1, 2, 3, 4, 5)
        service.hooks.reports.append(StepReport(step, [v]))
        service.fault_hooks._num_reports = len(service.hooks.reports)  # as the fault hooks do in a step
        service._feed_admin()
    assert len(service.hooks.reports) <= 256 and service.admin.log.next_id == 600
    assert service.fault_hooks._num_reports == len(service.hooks.reports)
    assert [r["step"] for r in service.admin.log.last(2)] == [598, 599]


def test_with_late_reports_a_stream_gets_only_tokens_whose_report_was_read():
    """Reports one step late (as on CUDA): after every engine step, what each generation was handed
    is exactly what the engine delivered, never a token still waiting for its step's report; an
    idle engine reads the last report and every generation finishes with all its tokens."""
    from kvcanary.config import Policy
    from kvcanary.server.service import EngineService

    service = EngineService(serve_config(Policy.RECOMPUTE))
    for canary in service.canaries():
        canary.reporter.lag = 1
    service.engine.delivery.lag = 1

    async def main():
        gens = await service.submit([_prompt(i) for i in range(3)], 6, [f"c{i}" for i in range(3)])
        held_back = 0
        for _ in range(200):
            if not service._can_step():
                break
            service._step()
            for gen in gens:
                req = service.engine.requests.get(gen.engine_id)
                if req is not None:
                    delivered = service.engine.delivery.count(gen.engine_id)
                    assert gen.tokens == req.output_ids[:delivered]
                    held_back += len(req.output_ids) - delivered
        return gens, held_back

    gens, held_back = asyncio.run(main())
    assert held_back > 0  # some tokens did wait for their report, so the check above could fail
    assert all(g.is_done and len(g.tokens) == 6 for g in gens) and not service.engine.delivery.has_pending


def test_openai_client_sampling_parameters(server):
    base, _ = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    ask = lambda **kw: client.completions.create(model="kv-canary-reference", prompt="a seeded prompt",  # noqa: E731
                                                 max_tokens=20, **kw).choices[0]
    a, b = ask(temperature=1.0, top_p=0.9, seed=7), ask(temperature=1.0, top_p=0.9, seed=7)
    assert a.text == b.text and a.text != ask(temperature=1.0, top_p=0.9, seed=8).text
    stop = a.text[4:6]
    cut = ask(temperature=1.0, top_p=0.9, seed=7, stop=[stop])
    assert (cut.text, cut.finish_reason) == (a.text[: a.text.find(stop)], "stop")
    chat = client.chat.completions.create(model="kv-canary-reference", max_tokens=8, seed=3, temperature=0.8,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError) as e:
        ask(logprobs=2)
    assert e.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="kv-canary-reference", prompt="x", max_tokens=2,
                                  extra_body={"min_tokens": 1})
    assert e.value.body["param"] == "min_tokens" and "unknown field" in e.value.body["message"]
