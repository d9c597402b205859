"""`inferd router` over two real `inferd-tiny` replicas on loopback: prefix locality, bad input
answered by the router, streaming pass-through, failover when a replica dies or drains.

The tests run in file order and the last ones take the replicas down one by one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from conftest import ROOT, ROUTER_LINE, Server, start_server, stop_server, wait_listening

PREFIX = (
    "You are a careful assistant for the city archive. The history of the city begins with a "
    "long account of its founding by travellers from the north, who crossed the mountains and "
    "settled by the river. "
)


@dataclass
class Cluster:
    replicas: list[Server]
    router: Server

    def post(self, path: str, body: dict[str, object]) -> httpx.Response:
        return httpx.post(f"{self.router.url}{path}", json=body, timeout=60)

    def router_metrics(self) -> dict[str, float]:
        return self.router.metrics()


def start_router(tmp: Path, replicas: list[Server], *extra: str) -> Server:
    """`inferd router` over `replicas` on a port the OS picks (`--port 0`, read back from its
    log), once it has every replica in rotation."""
    log = tmp / f"router-{uuid.uuid4().hex[:8]}.log"
    cmd = [sys.executable, "-m", "inferd.cli", "router", "--port", "0"]
    cmd += ["--health-interval", "0.5", "--max-retries", "2", *extra]
    for r in replicas:
        cmd += ["--replica", r.url]
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    router = wait_listening(proc, log, 60, ROUTER_LINE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready = httpx.get(f"{router.url}/health/ready", timeout=5).json()
        if ready.get("replicas_ready") == len(replicas):
            return router
        time.sleep(0.2)
    raise AssertionError(f"router not ready:\n{log.read_text()}")


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("router")
    with ThreadPoolExecutor(2) as pool:
        replicas = list(pool.map(lambda _: start_server(tmp), range(2)))
    router = start_router(tmp, replicas)
    yield Cluster(replicas, router)
    router.proc.terminate()
    router.proc.wait(timeout=30)
    for r in replicas:
        stop_server(r)


def completion(c: Cluster, prompt: str, max_tokens: int = 2) -> httpx.Response:
    return c.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens})


def test_requests_sharing_a_prefix_land_on_one_replica_and_groups_spread(c: Cluster) -> None:
    first = [completion(c, PREFIX + f"Question {i}: what happened?") for i in range(4)]
    other = [completion(c, "Unrelated topic number two, about rivers and lakes. " * 3)]
    assert all(r.status_code == 200 for r in first + other)
    homes = {r.headers["x-inferd-replica"] for r in first}
    assert len(homes) == 1
    # A new group goes to the replica holding less, not to the warm one.
    assert other[0].headers["x-inferd-replica"] not in homes
    assert int(first[-1].headers["x-inferd-route-cached-tokens"]) >= 32
    timings = first[-1].json()["timings"]
    assert next(iter(timings)) == "route" and timings["route"] >= 0
    hits = c.router_metrics()
    home = homes.pop()
    assert hits[f'inferd_router_requests_total{{outcome="cache_hit",replica="{home}"}}'] >= 3
    # The replicas agree: the warm one really had the prefix, the other computed only its own.
    assert first[-1].json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    by_url = {r.url: r.metrics() for r in c.replicas}
    assert by_url[home]["inferd_prefix_cache_hits_tokens_total"] >= 3 * 32
    cold = other[0].headers["x-inferd-replica"]
    assert by_url[cold]["inferd_prefix_cache_hits_tokens_total"] == 0
    # ...and the router shows their counters beside its estimate once it has scraped them.
    key = f'inferd_router_replica_prefix_cache_hits_tokens_total{{replica="{home}"}}'
    deadline = time.monotonic() + 5
    while c.router_metrics().get(key, 0) < 3 * 32:
        assert time.monotonic() < deadline, "the router never scraped the replica's counters"
        time.sleep(0.2)


def test_a_second_router_learns_where_a_prefix_lives_from_the_replicas_block_digest(
    c: Cluster, tmp_path: Path
) -> None:
    """Two routers that share no state: the second reads each replica's block digest with its
    health checks, so a prefix the first router placed is a cache hit for it too, before it has
    routed anything there itself."""
    prompt = "A second router's test. " + PREFIX + "The archive keeps maps of the old walls. "
    first = completion(c, prompt)
    assert first.status_code == 200, first.text
    home = first.headers["x-inferd-replica"]
    blocks = first.json()["usage"]["prompt_tokens"] // 16
    digest = httpx.get(f"{home}/v1/kv_cache/blocks", timeout=10).json()
    assert digest["num_cached"] >= blocks and len(digest["block_hashes"]) == digest["num_cached"]
    other = start_router(tmp_path, c.replicas)
    try:
        index = f'inferd_router_index_blocks{{replica="{home}"}}'
        deadline = time.monotonic() + 10
        while other.metrics().get(index, 0) < blocks:
            assert time.monotonic() < deadline, "the second router never read the digest"
            time.sleep(0.1)
        applied = f'inferd_router_replica_digests_total{{replica="{home}",result="applied"}}'
        assert other.metrics()[applied] >= 1
        body = {"prompt": prompt + "Who drew them?", "max_tokens": 2}
        r = httpx.post(f"{other.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["x-inferd-replica"] == home
        assert int(r.headers["x-inferd-route-cached-tokens"]) >= (blocks - 1) * 16
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= (blocks - 1) * 16
        hit = f'inferd_router_requests_total{{outcome="cache_hit",replica="{home}"}}'
        assert other.metrics()[hit] == 1
    finally:
        other.proc.terminate()
        other.proc.wait(timeout=30)


def test_multi_turn_chats_match_on_their_whole_history(c: Cluster) -> None:
    history: list[dict[str, str]] = [{"role": "system", "content": PREFIX}]
    seen = set()
    for turn in range(3):
        history.append({"role": "user", "content": f"Tell me more, part {turn}."})
        r = c.post("/v1/chat/completions", {"messages": history, "max_tokens": 3})
        assert r.status_code == 200, r.text
        seen.add(r.headers["x-inferd-replica"])
        history.append(
            {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}
        )
    assert len(seen) == 1


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": 5}, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/embeddings", {"model": "m"}, "input"),
    ],
)
def test_bad_input_is_answered_by_the_router(
    c: Cluster, path: str, body: dict[str, object], param: str
) -> None:
    before = sum(v for k, v in c.router_metrics().items() if "router_requests_total" in k)
    r = c.post(path, body)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert param in (r.json()["error"]["param"] or "")
    assert "x-inferd-replica" not in r.headers  # never forwarded
    after = sum(v for k, v in c.router_metrics().items() if "router_requests_total" in k)
    assert after == before


def test_malformed_json_is_a_400(c: Cluster) -> None:
    r = httpx.post(f"{c.router.url}/v1/completions", content=b"{bad", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_streaming_passes_through_with_the_openai_client(c: Cluster) -> None:
    with openai.OpenAI(base_url=f"{c.router.url}/v1", api_key="unused", max_retries=0) as client:
        stream = client.chat.completions.create(
            model="inferd-tiny",
            messages=[{"role": "user", "content": "Count to five."}],
            # Enough tokens to span several chunks: the engine's stream merges the deltas a slow
            # reader has not taken yet (engine/streams.py), and the tiny model decodes 6 tokens
            # in ~7 ms, which a loaded machine's reader can take as one chunk.
            max_tokens=64,
            extra_body={"ignore_eos": True},
            stream=True,
        )
        chunks = [ch for ch in stream if ch.choices]
        models = client.models.list()
    assert len(chunks) >= 2
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert [m.id for m in models.data] == ["inferd-tiny"]


def test_a_replica_killed_mid_run_costs_no_request_not_yet_streaming(c: Cluster) -> None:
    prompts = [PREFIX + f"Long answer {i}." for i in range(4)]
    prompts += [f"Another group entirely, item {i}. " * 4 for i in range(4)]
    body = {"max_tokens": 48, "ignore_eos": True}
    victim, survivor = c.replicas
    in_flight = f'inferd_router_in_flight{{replica="{victim.url}"}}'
    before = _retries(c)
    # The victim's engine is paused: what the router sends there is still in flight when the
    # victim dies, however fast the machine, so every such request must fail over.
    os.kill(victim.engine_pid(), signal.SIGSTOP)
    with ThreadPoolExecutor(8) as pool:
        futures = [
            pool.submit(c.post, "/v1/completions", {**body, "prompt": p}) for p in prompts * 2
        ]
        deadline = time.monotonic() + 30
        while (stuck := c.router_metrics().get(in_flight, 0)) < 1:
            assert time.monotonic() < deadline, "the router sent nothing to the victim"
            time.sleep(0.05)
        stop_server(victim)
        answers = [f.result() for f in futures]
    assert [r.status_code for r in answers] == [200] * len(answers)
    # The victim answered none of them: each one it held was retried on the survivor.
    assert {r.headers["x-inferd-replica"] for r in answers} == {survivor.url}
    assert _retries(c) - before >= stuck
    m = c.router_metrics()
    assert m[f'inferd_router_replica_ready{{replica="{victim.url}"}}'] == 0.0
    after = [completion(c, PREFIX + "After the failure.") for _ in range(3)]
    assert {r.headers["x-inferd-replica"] for r in after} == {survivor.url}


def _retries(c: Cluster) -> float:
    return sum(
        v for k, v in c.router_metrics().items() if k.startswith("inferd_router_retries_total")
    )


def test_a_draining_replica_leaves_rotation_and_then_503_with_retry_after(c: Cluster) -> None:
    last = c.replicas[1]
    last.proc.send_signal(signal.SIGTERM)  # drains: readiness red, then exits
    deadline = time.monotonic() + 5
    while httpx.get(f"{c.router.url}/health/ready", timeout=5).status_code == 200:
        assert time.monotonic() < deadline, "the draining replica stayed in rotation"
        time.sleep(0.1)
    r = completion(c, "hello")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "no_replica"
