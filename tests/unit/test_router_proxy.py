"""The router app in-process against scripted replicas (httpx.MockTransport), a unit test of its
proxy: retries, passive ejection, pass-through of a request's own failure, a stream broken
mid-way, timings, KServe. (tests/integration/test_router_replicas.py puts real replicas behind
it.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine, MutableMapping
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI
from prometheus_client import generate_latest

from inferd.kv_cache.block_hash import block_hashes
from inferd.preprocess.tokenizer import Tokenizer
from inferd.router.app import create_router_app
from inferd.router.config import RouterConfig
from inferd.router.health import report_from_metrics
from inferd.router.tokenize import load_tokenizer

Handler = Callable[[httpx.Request], Coroutine[None, None, httpx.Response]]
A, B = "http://a", "http://b"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("inferd-tiny", None, None)


def ok(replica: str, **extra: Any) -> httpx.Response:
    body = {"choices": [{"text": "x"}], "replica": replica, **extra}
    return httpx.Response(200, json=body)


def make_app(tok: Tokenizer, handler: Handler, max_retries: int = 1) -> FastAPI:
    cfg = RouterConfig(replicas=(A, B), max_retries=max_retries, policy="round_robin")
    app = create_router_app(cfg, tok, httpx.MockTransport(handler))
    for url in (A, B):
        app.state.router.cluster.set_health(url, ready=True)
    return app


def call(app: FastAPI, path: str, body: Any = None, content: bytes | None = None) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            if body is None and content is None:
                return await c.get(path)
            return await c.post(path, json=body, content=content)

    return asyncio.run(run())


COMPLETION = {"prompt": "hello there", "max_tokens": 2}


def test_a_draining_replica_is_retried_elsewhere_and_ejected(tok: Tokenizer) -> None:
    seen: list[str] = []

    async def handler(req: httpx.Request) -> httpx.Response:
        host = f"http://{req.url.host}"
        seen.append(host)
        if host == A:
            err = {"error": {"message": "shutting down", "code": "draining"}}
            return httpx.Response(503, json=err)
        return ok(host)

    app = make_app(tok, handler)
    r = call(app, "/v1/completions", COMPLETION)
    assert r.status_code == 200 and r.headers["x-inferd-replica"] == B
    assert seen == [A, B]
    cluster = app.state.router.cluster
    assert not cluster.replicas[A].ready and cluster.replicas[A].reason == "draining"
    assert r.json()["replica"] == B


def test_request_ids_are_the_same_on_every_try(tok: Tokenizer) -> None:
    ids: list[str] = []

    async def handler(req: httpx.Request) -> httpx.Response:
        ids.append(req.headers["x-request-id"])
        if req.url.host == "a":
            raise httpx.ConnectError("refused")
        return ok("b")

    app = make_app(tok, handler)
    assert call(app, "/v1/completions", COMPLETION).status_code == 200
    assert len(ids) == 2 and ids[0] == ids[1]
    assert not app.state.router.cluster.replicas[A].ready


def test_a_500_is_the_requests_own_failure_passed_through(tok: Tokenizer) -> None:
    async def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(500, json={"error": {"message": "bug", "code": "internal_error"}})

    app = make_app(tok, handler)
    r = call(app, "/v1/completions", COMPLETION)
    assert r.status_code == 500
    assert all(rep.ready for rep in app.state.router.cluster.replicas.values())


def test_when_every_try_is_refused_the_last_answer_passes_through(tok: Tokenizer) -> None:
    async def handler(req: httpx.Request) -> httpx.Response:
        body = {"error": {"message": "full", "code": "queue_full"}}
        return httpx.Response(429, json=body, headers={"Retry-After": "3"})

    r = call(make_app(tok, handler), "/v1/completions", COMPLETION)
    assert r.status_code == 429 and r.headers["retry-after"] == "3"


class _Broken(httpx.AsyncByteStream):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b'data: {"choices": [{"text": "a"}]}\n\n'
        raise httpx.ReadError("replica died")


def test_a_stream_broken_mid_way_ends_with_an_error_event(tok: Tokenizer) -> None:
    async def handler(req: httpx.Request) -> httpx.Response:
        headers = {"content-type": "text/event-stream"}
        return httpx.Response(200, headers=headers, stream=_Broken())

    app = make_app(tok, handler)
    r = call(app, "/v1/completions", {**COMPLETION, "stream": True})
    events = [e for e in r.text.split("\n\n") if e.strip()]
    assert events[0].startswith('data: {"choices"')
    assert orjson.loads(events[1].removeprefix("data: "))["error"]["code"] == "replica_failed"
    assert events[-1] == "data: [DONE]"
    cluster = app.state.router.cluster
    assert sum(not rep.ready for rep in cluster.replicas.values()) == 1
    assert all(rep.load.in_flight == 0 for rep in cluster.replicas.values())


def test_route_timing_leads_the_replicas_timings(tok: Tokenizer) -> None:
    async def handler(req: httpx.Request) -> httpx.Response:
        return ok("a", timings={"receive": 0.1, "queue": 0.2})

    r = call(
        make_app(tok, handler),
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}]},
    )
    timings = r.json()["timings"]
    assert list(timings) == ["route", "receive", "queue"] and timings["route"] >= 0


def test_kserve_requests_pass_through_byte_for_byte(tok: Tokenizer) -> None:
    got: list[tuple[str, bytes]] = []

    async def handler(req: httpx.Request) -> httpx.Response:
        got.append((req.url.path, req.content))
        return httpx.Response(200, json={"model_name": "m", "outputs": []})

    raw = b'{"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}'
    r = call(make_app(tok, handler), "/v2/models/m/infer", content=raw)
    assert r.status_code == 200 and got == [("/v2/models/m/infer", raw)]


def test_no_ready_replica_is_503_with_retry_after_in_each_protocols_form(tok: Tokenizer) -> None:
    async def handler(req: httpx.Request) -> httpx.Response:
        raise AssertionError("nothing may be forwarded")

    app = make_app(tok, handler)
    for url in (A, B):
        app.state.router.cluster.set_health(url, ready=False)
    r = call(app, "/v1/completions", COMPLETION)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "no_replica"
    v2 = call(app, "/v2/models/m/infer", content=b"{}")
    assert v2.status_code == 503 and v2.json() == {"error": "no replica is ready"}
    assert call(app, "/health/ready").status_code == 503


def test_replica_reports_come_from_its_metrics_page() -> None:
    page = (
        "# HELP inferd_num_requests_running x\n"
        "inferd_num_requests_running 3.0\n"
        "inferd_queued_prompt_tokens 120.0\n"
        "inferd_kv_cache_usage_ratio 0.5\n"
        "inferd_prefix_cache_queries_tokens_total 400.0\n"
        "inferd_prefix_cache_hits_tokens_total 256.0\n"
        'inferd_cache_config_info{block_size="16",num_blocks="512",cache_dtype="float32"} 1.0\n'
    )
    report = report_from_metrics(page)
    assert (report.running, report.queued_prompt_tokens, report.kv_cache_usage) == (3, 120, 0.5)
    assert (report.prefix_queries_tokens, report.prefix_hits_tokens) == (400, 256)
    assert (report.block_size, report.num_blocks) == (16, 512)
    assert report_from_metrics("") == type(report)()


def test_a_client_leaving_cancels_the_upstream_request(tok: Tokenizer) -> None:
    cancelled, forwarded = asyncio.Event(), asyncio.Event()

    async def handler(req: httpx.Request) -> httpx.Response:
        forwarded.set()
        try:
            await asyncio.sleep(60)  # the replica still prefilling
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return ok("a")

    app = make_app(tok, handler)
    body = orjson.dumps(COMPLETION)
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> MutableMapping[str, Any]:
        if messages:
            return messages.pop()
        await forwarded.wait()  # the client leaves once the replica has the request
        return {"type": "http.disconnect"}

    sent: list[MutableMapping[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "server": ("router", 80),
        "client": ("client", 1234),
        "scheme": "http",
        "root_path": "",
    }

    async def run() -> None:
        await asyncio.wait_for(app(scope, receive, send), timeout=10)

    asyncio.run(run())
    assert cancelled.is_set()
    assert all(r.load.in_flight == 0 for r in app.state.router.cluster.replicas.values())


class _Chunks(httpx.AsyncByteStream):
    """A stream cut at awkward places: mid-event, mid-key."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [], "tim'
        yield b'ings": {"receive": 0.1}}\n\n'
        yield b"data: [DONE]\n\n"


def test_a_streams_last_event_gets_the_route_stage(tok: Tokenizer) -> None:
    async def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Chunks())

    r = call(make_app(tok, handler), "/v1/completions", {**COMPLETION, "stream": True})
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
    assert events[0] == '{"choices": [{"text": "a"}]}'  # untouched, byte for byte
    assert list(orjson.loads(events[1])["timings"]) == ["route", "receive"]
    assert events[2] == "[DONE]"


def test_dns_discovery_adds_every_address_and_checks_it(tok: Tokenizer) -> None:
    async def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/health/ready":
            return httpx.Response(200, json={"status": "ready"})
        return httpx.Response(
            200, text='inferd_cache_config_info{block_size="32",num_blocks="8"} 1\n'
        )

    cfg = RouterConfig(dns_name="localhost:8001", index_capacity_blocks=100)
    app = create_router_app(cfg, tok, httpx.MockTransport(handler))
    router = app.state.router

    asyncio.run(router.health.check_all())
    assert "http://127.0.0.1:8001" in router.cluster.names()
    assert router.cluster.replicas["http://127.0.0.1:8001"].ready
    assert router.cluster.index.capacity("http://127.0.0.1:8001") == 8


def test_health_checks_read_the_replicas_block_digests(tok: Tokenizer) -> None:
    # A serves its digest (behind a key), B is an older replica without the route (404), C
    # hashes with another block size: only A's digest reaches the index, B is asked once.
    prompt = list(range(100, 164))
    asked: list[str] = []

    async def handler(req: httpx.Request) -> httpx.Response:
        host = req.url.host
        if req.url.path == "/health/ready":
            return httpx.Response(200, json={"status": "ready"})
        if req.url.path != "/v1/kv_cache/blocks":
            return httpx.Response(200, text="")
        asked.append(host)
        if host == "b":
            return httpx.Response(404, json={"detail": "Not Found"})
        if req.headers.get("authorization") != "Bearer k":
            return httpx.Response(401, json={"error": {"message": "no key"}})
        body = {
            "block_size": 16 if host == "a" else 32,
            "hash_version": "inferd-block-hash-v1",
            "block_hashes": block_hashes(prompt, 16),
            "num_recent": 0,
        }
        return httpx.Response(200, json=body)

    c = "http://c"
    cfg = RouterConfig(replicas=(A, B, c), replica_api_key="k")
    app = create_router_app(cfg, tok, httpx.MockTransport(handler))
    router = app.state.router
    for _ in range(2):
        asyncio.run(router.health.check_all())
    index = router.cluster.index
    assert (index.match(A, block_hashes(prompt, 16)), index.size(B), index.size(c)) == (4, 0, 0)
    assert sorted(asked) == ["a", "a", "b", "c", "c"]
    page = generate_latest(router.metrics.registry).decode()
    for replica, result, n in ((A, "applied", 2), (B, "unsupported", 1), (c, "failed", 2)):
        line = f'inferd_router_replica_digests_total{{replica="{replica}",result="{result}"}}'
        assert f"{line} {n}.0" in page
    # A replica whose index follows its KV events is never asked: its index is exact.
    exact = create_router_app(
        RouterConfig(replicas=(A,), kv_events=((A, "tcp://127.0.0.1:1"),)),
        tok,
        httpx.MockTransport(handler),
    )
    asked.clear()
    asyncio.run(exact.state.router.health.check(A))
    assert asked == []


def test_a_replica_whose_digests_take_long_is_asked_less_often(tok: Tokenizer) -> None:
    # Applying a digest costs the router time in its event loop; all of them together get at
    # most `digest_time_share` of it, so here (a share of ~0) every later check skips it.
    asked: list[str] = []

    async def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/health/ready":
            return httpx.Response(200, json={"status": "ready"})
        if req.url.path != "/v1/kv_cache/blocks":
            return httpx.Response(200, text="")
        asked.append(req.url.params["recent_s"])
        body = {"block_size": 16, "hash_version": "inferd-block-hash-v1", "block_hashes": []}
        return httpx.Response(200, json=body)

    app = create_router_app(RouterConfig(replicas=(A,)), tok, httpx.MockTransport(handler))
    health = app.state.router.health
    for _ in range(3):
        asyncio.run(health.check_all())
    assert asked == ["4.0"] * 3  # cheap: every check, live = used within two checks
    health.digests.time_share = 1e-9
    for _ in range(3):
        asyncio.run(health.check_all())
    assert len(asked) == 4 and float(asked[-1]) == 4.0  # the first applies, then none is due


def test_a_request_naming_an_adapter_routes_on_the_adapters_blocks(tok: Tokenizer) -> None:
    # The replicas list "sql" as an adapter (`parent`): its prompt is hashed under it, as their
    # prefix caches key it, and its next new prompt follows it to the same replica.
    sent: list[tuple[str, bytes]] = []

    async def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/health/ready":
            return httpx.Response(200, json={"status": "ready"})
        if req.url.path == "/v1/models":
            cards = [{"id": "inferd-tiny"}, {"id": "sql", "parent": "inferd-tiny", "root": "/a"}]
            return httpx.Response(200, json={"object": "list", "data": cards})
        if req.url.path == "/v1/completions":
            sent.append((req.url.host, req.content))
            return ok(req.url.host)
        return httpx.Response(200, text="")

    cfg = RouterConfig(replicas=(A, B), replica_digest=False)
    app = create_router_app(cfg, tok, httpx.MockTransport(handler))
    router = app.state.router
    asyncio.run(router.health.check_all())
    prompt = "the quick brown fox jumps over the lazy dog " * 8
    body = {"model": "sql", "prompt": prompt, "max_tokens": 2}
    r = call(app, "/v1/completions", body)
    assert r.status_code == 200 and orjson.loads(sent[0][1]) == body  # forwarded as sent
    replica = r.headers["x-inferd-replica"]
    ids = tok.encode(prompt)
    index = router.cluster.index
    assert index.match(replica, block_hashes(ids, 16, lora_name="sql")) == len(ids) // 16 > 0
    assert index.match(replica, block_hashes(ids, 16)) == 0
    for i in range(4):  # new prompts under the adapter: where it ran last
        other = {"model": "sql", "prompt": f"{i} another prompt " * 10, "max_tokens": 2}
        assert call(app, "/v1/completions", other).headers["x-inferd-replica"] == replica
