"""The router's exact prefix index over two real `inferd-tiny` replicas, each publishing its KV
events on its own endpoint: the router indexes what the serving replica really stored, and a
request with the same prompt prefix goes back there."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import Server, probe_prompt, start_server, stop_server
from test_router import PREFIX, Cluster, completion, start_router

BLOCK_SIZE = 16  # the replicas' and the router's default


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("router-kv")
    endpoints = [f"ipc://{tmp}/kv-{i}" for i in range(2)]  # socket paths: no port races
    with ThreadPoolExecutor(2) as pool:
        replicas = list(
            pool.map(lambda ep: start_server(tmp, "--kv-events-endpoint", ep), endpoints)
        )
    follow = []
    for replica, endpoint in zip(replicas, endpoints, strict=True):
        follow += ["--replica-kv-events", f"{replica.url}={endpoint}"]
    router = start_router(tmp, replicas, *follow)
    cluster = Cluster(replicas, router)
    for replica in replicas:
        router_follows(cluster, replica)
    yield cluster
    router.proc.terminate()
    router.proc.wait(timeout=30)
    for r in replicas:
        stop_server(r)


def router_follows(c: Cluster, replica: Server, timeout_s: float = 60) -> None:
    """Sends probe prompts straight to `replica` until the router has counted a BlockStored
    event from it: ZeroMQ's slow joiner drops what a replica publishes before the router's
    subscription has reached it, so a test's first request could otherwise go unindexed."""
    stored = f'inferd_router_kv_events_total{{kind="stored",replica="{replica.url}"}}'
    deadline = time.monotonic() + timeout_s
    for i in itertools.count():
        assert time.monotonic() < deadline, "the router never received the replica's events"
        body = {"prompt": probe_prompt(i), "max_tokens": 1}
        assert httpx.post(f"{replica.url}/v1/completions", json=body, timeout=30).status_code == 200
        wait = time.monotonic() + 2
        while time.monotonic() < wait:
            if c.router_metrics().get(stored, 0) >= 1:
                return
            time.sleep(0.05)


def index_blocks(c: Cluster, replica: str) -> float:
    return c.router_metrics().get(f'inferd_router_index_blocks{{replica="{replica}"}}', 0.0)


def test_the_index_holds_what_the_replica_stored_and_the_prefix_goes_back_there(
    c: Cluster,
) -> None:
    prompt = PREFIX * 2
    before = {r.url: index_blocks(c, r.url) for r in c.replicas}  # the probes' blocks
    first = completion(c, prompt)
    assert first.status_code == 200, first.text
    home = first.headers["x-inferd-replica"]
    other = next(r.url for r in c.replicas if r.url != home)
    blocks = first.json()["usage"]["prompt_tokens"] // BLOCK_SIZE
    assert blocks >= 4
    # The index is fed by the replica's BlockStored events, not by the routing decision.
    deadline = time.monotonic() + 10
    while index_blocks(c, home) < before[home] + blocks:
        assert time.monotonic() < deadline, "the router never indexed the replica's blocks"
        time.sleep(0.1)
    samples = c.router_metrics()
    stored = f'inferd_router_kv_events_total{{kind="stored",replica="{home}"}}'
    assert samples[stored] >= 1
    # Not the other's (a probe's event still on the way adds one block, not the prompt's).
    assert index_blocks(c, other) < before[other] + blocks
    overview = httpx.get(f"{c.router.url}/v1/dashboard/overview", timeout=10).json()
    assert all(row["index_exact"] for row in overview["replicas"])
    # Every one of the prompt's block hashes is indexed for the home replica (the router's
    # estimate is the whole prompt's full blocks), and the replica agrees it had them cached.
    again = completion(c, prompt)
    assert again.headers["x-inferd-replica"] == home
    assert int(again.headers["x-inferd-route-cached-tokens"]) == blocks * BLOCK_SIZE
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= BLOCK_SIZE
    variant = completion(c, prompt + "Which river was it?")
    assert variant.headers["x-inferd-replica"] == home
    assert int(variant.headers["x-inferd-route-cached-tokens"]) >= (blocks - 1) * BLOCK_SIZE
