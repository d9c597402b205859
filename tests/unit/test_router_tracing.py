"""The router's `inferd.route` span and the trace link to the replica: the router in-process in
front of a real gateway app (a fake engine behind it), both tracing into one in-memory exporter,
so the test sees the replica's `inferd.request` span as the router's child in one trace."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

pytest.importorskip("opentelemetry.sdk.trace", reason="needs the otel extra")
from fake_llm import FakeLLM
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from inferd.config import ServerConfig
from inferd.gateway import create_app
from inferd.preprocess.tokenizer import Tokenizer
from inferd.router.app import create_router_app
from inferd.router.config import RouterConfig
from inferd.router.tokenize import load_tokenizer
from inferd.router.tracing import RouteTracer
from inferd.telemetry.tracing import RequestTracer

A, B = "http://a", "http://b"
COMPLETION = {"prompt": "hello there", "max_tokens": 2}
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("inferd-tiny", None, None)


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


def _tracer(exporter: InMemorySpanExporter, name: str) -> Any:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer(name)


def _router(
    tok: Tokenizer, exporter: InMemorySpanExporter, transport: httpx.AsyncBaseTransport
) -> FastAPI:
    cfg = RouterConfig(replicas=(A, B), policy="round_robin", max_retries=1)
    tracer = RouteTracer(_tracer(exporter, "router"), cfg.policy)
    app = create_router_app(cfg, tok, transport, tracer)
    for url in (A, B):
        app.state.router.cluster.set_health(url, ready=True)
    return app


def _replica(exporter: InMemorySpanExporter) -> FastAPI:
    tracer = RequestTracer(_tracer(exporter, "replica"))
    return create_app(FakeLLM(), ServerConfig(access_log=False), tracer=tracer)


def _post(
    app: FastAPI, headers: dict[str, str] | None = None, stream: bool = False
) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        body = {**COMPLETION, "stream": stream}
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            return await c.post("/v1/completions", json=body, headers=headers)

    return asyncio.run(run())


def _named(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    spans = [s for s in exporter.get_finished_spans() if s.name == name]
    assert len(spans) == 1, [s.name for s in exporter.get_finished_spans()]
    return spans[0]


@pytest.mark.parametrize("stream", [False, True])
def test_the_replicas_request_span_is_the_routers_child(
    tok: Tokenizer, exporter: InMemorySpanExporter, stream: bool
) -> None:
    r = _post(_router(tok, exporter, httpx.ASGITransport(app=_replica(exporter))), stream=stream)
    assert r.status_code == 200, r.text
    assert ("data: [DONE]" in r.text) == stream
    route, replica = _named(exporter, "inferd.route"), _named(exporter, "inferd.request")
    assert route.context is not None and replica.context is not None
    assert replica.context.trace_id == route.context.trace_id
    assert replica.parent is not None and replica.parent.span_id == route.context.span_id
    assert route.parent is None  # the client sent no trace context
    attrs = dict(route.attributes or {})
    assert attrs["inferd.route.policy"] == "round_robin"
    assert attrs["inferd.route.outcome"] == "round_robin"
    assert attrs["inferd.route.replica"] == r.headers["x-inferd-replica"]
    assert attrs["inferd.route.retries"] == 0
    assert attrs["inferd.route.cached_tokens"] == int(r.headers["x-inferd-route-cached-tokens"])
    assert isinstance(attrs["inferd.prompt_tokens"], int) and attrs["inferd.prompt_tokens"] > 0
    assert attrs["inferd.request_id"] == r.headers["x-request-id"]
    assert attrs["http.response.status_code"] == 200
    # The replica's span lies inside the router's (the router's covers the whole answer).
    assert route.start_time is not None and replica.start_time is not None
    assert route.end_time is not None and replica.end_time is not None
    assert route.start_time <= replica.start_time and replica.end_time <= route.end_time


def test_a_clients_trace_context_is_the_routers_parent(
    tok: Tokenizer, exporter: InMemorySpanExporter
) -> None:
    seen: list[str] = []

    async def replica(req: httpx.Request) -> httpx.Response:
        seen.append(req.headers["traceparent"])
        return httpx.Response(200, json={"choices": [{"text": "x"}]})

    r = _post(_router(tok, exporter, httpx.MockTransport(replica)), {"traceparent": CLIENT_PARENT})
    assert r.status_code == 200
    route = _named(exporter, "inferd.route")
    assert route.context is not None and route.parent is not None
    assert format(route.context.trace_id, "032x") == CLIENT_TRACE
    # The replica is told the router's span, not the client's, as its parent.
    assert seen == [f"00-{CLIENT_TRACE}-{route.context.span_id:016x}-01"]


def test_retries_and_the_replica_that_answered_are_on_the_span(
    tok: Tokenizer, exporter: InMemorySpanExporter
) -> None:
    async def replica(req: httpx.Request) -> httpx.Response:
        if req.url.host == "a":
            raise httpx.ConnectError("refused")
        return httpx.Response(200, json={"choices": [{"text": "x"}]})

    # Garbage trace context from the client is ignored (a new trace), never an error.
    r = _post(_router(tok, exporter, httpx.MockTransport(replica)), {"traceparent": "zz-1"})
    assert r.status_code == 200
    attrs = dict(_named(exporter, "inferd.route").attributes or {})
    assert attrs["inferd.route.replica"] == B and attrs["inferd.route.retries"] == 1


def test_with_tracing_off_the_clients_trace_context_passes_through(tok: Tokenizer) -> None:
    seen: list[str] = []

    async def replica(req: httpx.Request) -> httpx.Response:
        seen.append(req.headers["traceparent"])
        return httpx.Response(200, json={"choices": [{"text": "x"}]})

    cfg = RouterConfig(replicas=(A,), policy="round_robin")
    app = create_router_app(cfg, tok, httpx.MockTransport(replica))
    app.state.router.cluster.set_health(A, ready=True)
    assert app.state.router.tracer is None
    assert _post(app, {"traceparent": CLIENT_PARENT}).status_code == 200
    assert seen == [CLIENT_PARENT]
