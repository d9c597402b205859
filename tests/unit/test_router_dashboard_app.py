"""The router's dashboard in-process against scripted replicas: the page and its assets, the
overview after routed requests, the stream's end at shutdown, `--disable-dashboard`."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI

from inferd.preprocess.tokenizer import Tokenizer
from inferd.router.app import create_router_app
from inferd.router.config import RouterConfig
from inferd.router.tokenize import load_tokenizer

A, B = "http://a", "http://b"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("inferd-tiny", None, None)


async def replica(req: httpx.Request) -> httpx.Response:
    if req.url.path == "/v1/dashboard/overview":
        return httpx.Response(200, json={"from": "replica"})
    return httpx.Response(200, json={"choices": [{"text": "x"}]})


def make_app(tok: Tokenizer, dashboard: bool = True) -> FastAPI:
    cfg = RouterConfig(replicas=(A, B), policy="round_robin", dashboard=dashboard)
    app = create_router_app(cfg, tok, httpx.MockTransport(replica))
    for url in (A, B):
        app.state.router.cluster.set_health(url, ready=True)
    return app


def get_all(app: FastAPI, *paths: str, posts: int = 0) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            for i in range(posts):
                body = {"prompt": f"hello {i}", "max_tokens": 2}
                assert (await c.post("/v1/completions", json=body)).status_code == 200
            return [await c.get(p) for p in paths]

    return asyncio.run(run())


def test_page_assets_and_overview(tok: Tokenizer) -> None:
    page, script, common, style, missing, doc = get_all(
        make_app(tok),
        "/dashboard",
        "/dashboard/static/router.js",
        "/dashboard/static/common.js",
        "/dashboard/static/style.css",
        "/dashboard/static/secret.py",
        "/v1/dashboard/overview?window=30",
        posts=4,
    )
    assert page.headers["content-type"].startswith("text/html") and "router.js" in page.text
    assert script.headers["content-type"].startswith("text/javascript")
    assert "streamEvents" in common.text and "common.js" in page.text
    assert style.status_code == 200 and missing.status_code == 404
    overview = doc.json()
    assert overview["window_s"] == 30.0 and overview["outcomes"] == {"round_robin": 4}
    replicas = {r["url"]: r for r in overview["replicas"]}
    assert {u: r["routed"] for u, r in replicas.items()} == {A: 2, B: 2}
    assert all(r["in_flight"] == 0 and r["state"] == "healthy" for r in replicas.values())


def test_event_stream_ends_when_the_router_stops(tok: Tokenizer) -> None:
    app = make_app(tok)
    app.state.router.stopping = True
    (events,) = get_all(app, "/v1/dashboard/events?interval=0.25")
    assert events.headers["content-type"].startswith("text/event-stream")
    assert events.text == "retry: 2000\n\n"


def test_disable_dashboard_leaves_the_routes_out(tok: Tokenizer) -> None:
    page, doc = get_all(make_app(tok, dashboard=False), "/dashboard", "/v1/dashboard/overview")
    assert page.status_code == 404
    # Without the router's own route the path is a /v1 path like any other: a replica answers.
    assert doc.json() == {"from": "replica"}
