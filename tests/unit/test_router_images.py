"""The router with image requests: each costs its latent pixel-steps, and goes to the replica with
the fewest in flight, not the one with the fewest requests (router/image_cost.py)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest

from inferd.router.app import create_router_app
from inferd.router.cluster import Cluster
from inferd.router.command import router_config
from inferd.router.config import RouterConfig
from inferd.router.image_cost import image_cost, parse_size

A, B = "http://a", "http://b"
DEFAULTS = (50, (512, 512))


def cost(body: Any) -> int:
    return image_cost(body, *DEFAULTS)


def test_the_cost_is_images_times_steps_times_latent_pixels() -> None:
    assert cost({"prompt": "x"}) == 50 * 64 * 64
    assert cost({"n": 2, "num_inference_steps": 20, "size": "256x128"}) == 2 * 20 * 32 * 16
    # A size not a multiple of 8 rounds up, as the latents would (the replica refuses it anyway).
    assert cost({"size": "12x8", "num_inference_steps": 1}) == 2 * 1


@pytest.mark.parametrize(
    "body",
    [
        [],
        "x",
        {"n": "2"},
        {"n": True},
        {"n": 0},
        {"num_inference_steps": -3},
        {"size": "auto"},
        {"size": "0x512"},
        {"size": 512},
        {"size": "512x512x3"},
    ],
)
def test_a_malformed_field_counts_as_its_default(body: Any) -> None:
    assert cost(body) == 50 * 64 * 64


def test_the_size_flag_parses_wxh() -> None:
    assert parse_size("768x512") == (768, 512)
    for bad in ("768", "x512", "0x512", "768x512px"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_the_router_flags_set_the_defaults() -> None:
    from inferd.cli import build_parser

    args = build_parser().parse_args(
        ["router", "--replica", A, "--image-default-steps", "30", "--image-default-size", "64x64"]
    )
    config = router_config(args)
    assert (config.image_default_steps, config.image_default_size) == (30, (64, 64))


def cluster() -> Cluster:
    c = Cluster(RouterConfig(replicas=(A, B), seed=0), random.Random(0))
    for url in (A, B):
        c.set_health(url, ready=True)
    return c


def test_image_requests_go_where_the_fewest_pixel_steps_are_in_flight() -> None:
    c = cluster()
    big = c.route_image(cost({"size": "1024x1024"}))
    held = c.dispatch(big.decision.replica, big)
    other = B if held.replica == A else A
    # Sixteen small requests fit beside the big one before it is the lesser load again.
    small = cost({"size": "256x256"})
    tickets = []
    for _ in range(15):
        routed = c.route_image(small)
        assert routed.decision.replica == other
        tickets.append(c.dispatch(routed.decision.replica, routed))
    assert c.replicas[other].load.image_work == 15 * small < held.image_work
    held.finish()
    assert c.replicas[held.replica].load.image_work == 0
    assert c.route_image(small).decision.replica == held.replica
    for t in tickets:
        t.finish()
        t.finish()  # idempotent: the cost is undone once
    assert all(r.load.image_work == 0 and r.load.in_flight == 0 for r in c.replicas.values())


def test_equal_replicas_take_image_requests_in_turn() -> None:
    c = cluster()
    chosen = {c.route_image(100).decision.replica for _ in range(4)}
    assert chosen == {A, B}


def test_the_app_routes_by_cost_retries_and_releases_it() -> None:
    seen: list[tuple[str, int]] = []
    release = asyncio.Event()

    async def handler(req: httpx.Request) -> httpx.Response:
        host = f"http://{req.url.host}"
        work = app.state.router.cluster.replicas[host].load.image_work
        seen.append((host, work))
        if host == A and len(seen) == 1:
            raise httpx.ConnectError("refused")  # the first try fails: retried on B
        if len(seen) == 2:
            await release.wait()  # the big request stays in flight on B
        return httpx.Response(200, json={"created": 0, "data": [{"b64_json": ""}]})

    cfg = RouterConfig(replicas=(A, B), max_retries=1, image_default_size=(64, 64))
    app = create_router_app(cfg, None, httpx.MockTransport(handler))
    cluster = app.state.router.cluster
    for url in (A, B):
        cluster.set_health(url, ready=True)
    big = {"prompt": "p", "size": "512x512", "num_inference_steps": 20}

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            first = asyncio.create_task(client.post("/v1/images/generations", json=big))
            while len(seen) < 2:
                await asyncio.sleep(0.01)
            cluster.set_health(A, ready=True)  # back in rotation after its connect error
            small = await client.post("/v1/images/generations", json={"prompt": "q"})
            release.set()
            return [await first, small]

    first, small = asyncio.run(run())
    assert first.status_code == 200 and small.status_code == 200
    # Try 1 on A failed, the retry went to B (holding its cost while it ran), the small one
    # (the default 64x64) went to A, the replica with nothing in flight.
    assert [host for host, _ in seen] == [A, B, A]
    assert seen[1][1] == image_cost(big, 50, (64, 64)) and seen[2][1] == 50 * 8 * 8
    assert all(r.load.image_work == 0 for r in cluster.replicas.values())
    text = generate_latest(app.state.router.metrics.registry).decode()
    assert 'inferd_router_image_work{replica="http://b"} 0.0' in text


def test_malformed_json_is_a_400_in_openai_form() -> None:
    async def handler(req: httpx.Request) -> httpx.Response:
        raise AssertionError("never forwarded")

    app = create_router_app(RouterConfig(replicas=(A,)), None, httpx.MockTransport(handler))
    app.state.router.cluster.set_health(A, ready=True)

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            return await client.post("/v1/images/generations", content=b"{nope")

    r = asyncio.run(run())
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
