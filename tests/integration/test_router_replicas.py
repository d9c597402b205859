"""The router in front of two real replicas, all in this process: each replica is the gateway app
on uvicorn with inferd-tiny on a real engine core (kserve_server.serve), the router's app is
called through httpx's ASGI transport and reaches them over loopback. Nothing waits on a clock:
the router learns the replicas' state from one health round the test runs, requests go one at a
time, and a replica is made to drain by setting its state.

(tests/unit/test_router_proxy.py tests the proxy against scripted replicas; tests/e2e/
test_router.py runs `inferd router` and `inferd serve` as processes.)"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import httpx
import pytest
from fastapi import FastAPI
from kserve_server import LiveServer, serve
from prometheus_client import generate_latest

from inferd.config import EngineConfig
from inferd.router.app import create_router_app
from inferd.router.config import RouterConfig
from inferd.router.tokenize import load_tokenizer

pytestmark = pytest.mark.timeout(300)

T = TypeVar("T")
PREFIX = (
    "You are a careful assistant for the city archive. The history of the city begins with a "
    "long account of its founding by travellers from the north, who crossed the mountains and "
    "settled by the river. "
)
ENGINE = EngineConfig.from_kwargs(dtype="float32", kv_cache_memory=8 << 20, max_model_len=256)


@pytest.fixture(scope="module")
def replicas() -> Iterator[tuple[LiveServer, LiveServer]]:
    with serve(None, engine=ENGINE) as a, serve(None, engine=ENGINE) as b:
        yield a, b


def with_router(
    replicas: tuple[LiveServer, LiveServer],
    test: Callable[[FastAPI, httpx.AsyncClient], Awaitable[T]],
    **config: Any,
) -> T:
    """Runs `test` against a fresh router over the replicas, once a health round has read them."""

    async def main() -> T:
        urls = tuple(r.url for r in replicas)
        app = create_router_app(
            RouterConfig(replicas=urls, **config), load_tokenizer("inferd-tiny", None, None)
        )
        router = app.state.router
        await router.health.check_all()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://router", timeout=60
            ) as c:
                return await test(app, c)
        finally:
            await router.close()

    return asyncio.run(main())


def completion(prompt: str) -> dict[str, object]:
    return {"prompt": prompt, "max_tokens": 2}


def metric(app: FastAPI, name: str) -> float:
    text = generate_latest(app.state.router.metrics.registry).decode()
    return sum(
        float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(name)
    )


def test_a_shared_prefix_goes_where_the_real_cache_holds_it(
    replicas: tuple[LiveServer, LiveServer],
) -> None:
    async def test(app: FastAPI, c: httpx.AsyncClient) -> None:
        assert app.state.router.cluster.replicas[replicas[0].url].ready
        first = [
            await c.post("/v1/completions", json=completion(PREFIX + f"Question {i}: why?"))
            for i in range(4)
        ]
        assert [r.status_code for r in first] == [200] * 4, first[-1].text
        homes = {r.headers["x-inferd-replica"] for r in first}
        assert len(homes) == 1
        # The router's estimate and the replica's own prefix cache agree: it was there.
        last = first[-1]
        assert int(last.headers["x-inferd-route-cached-tokens"]) >= 32
        assert last.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
        assert next(iter(last.json()["timings"])) == "route"
        hits = 'inferd_router_requests_total{outcome="cache_hit"'
        assert metric(app, hits) >= 3
        # A new prefix group goes to the replica that holds less.
        other = await c.post("/v1/completions", json=completion("Rivers and lakes. " * 6))
        assert other.status_code == 200 and other.headers["x-inferd-replica"] not in homes

    with_router(replicas, test)


def test_a_draining_replica_is_retried_on_the_other_and_leaves_rotation(
    replicas: tuple[LiveServer, LiveServer],
) -> None:
    draining, serving = replicas

    async def test(app: FastAPI, c: httpx.AsyncClient) -> None:
        draining.state.draining = True  # answers 503 "draining" from now on, as on SIGTERM
        try:
            # Round robin over two ready replicas: one of two requests tries the draining one.
            answers = [
                await c.post("/v1/completions", json=completion(f"Story number {i}. " * 4))
                for i in range(2)
            ]
        finally:
            draining.state.draining = False
        assert [r.status_code for r in answers] == [200, 200]
        assert {r.headers["x-inferd-replica"] for r in answers} == {serving.url}
        assert metric(app, 'inferd_router_retries_total{reason="draining"}') == 1
        state = app.state.router.cluster.replicas[draining.url]
        assert not state.ready and state.reason == "draining"

    with_router(replicas, test, policy="round_robin", max_retries=1)
