"""The Ray Serve path (`inferd[ray]`): two `inferd-tiny` engine replicas as one Serve deployment
behind the ingress, routed by inferd's cache-aware `RequestRouter`, driven with the `openai`
client on a local Ray (2 CPUs, no dashboard, no usage stats). Skipped when ray is not installed.

The tests share one application (module fixture) and run in file order; the last one kills a
replica actor, and shutdown follows."""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from conftest import SMALL

# Ray reads this when it starts; set before `ray.init` so no usage report is attempted.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Serve's controller gives a starting proxy actor 5 s to report ready, then kills it with
# ray.kill and starts another: on a loaded 2-core machine a proxy can take longer than that, and
# each one was killed before it ran. The cluster's processes inherit this from `ray.init`.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "120")
START_DEADLINE_S = 300.0  # Serve's own readiness, waited for on a loaded 2-core machine
ray = pytest.importorskip("ray", reason="the Ray Serve path needs the ray extra")
serve = pytest.importorskip("ray.serve")

from ray.serve.schema import ProxyStatus  # noqa: E402

from inferd.cli import build_parser  # noqa: E402
from inferd.cli import serve_config as config_from_args  # noqa: E402
from inferd.config import ServeConfig, read_environment  # noqa: E402
from inferd.router.ray_serve import RayServeOptions, build_app  # noqa: E402
from inferd.telemetry.metrics import parse_samples  # noqa: E402

PREFIX = (
    "You are a careful assistant for the city archive. The history of the city begins with a "
    "long account of its founding by travellers from the north, who crossed the mountains and "
    "settled by the river. "
)
REPLICA = "x-inferd-replica"


def serve_config(flags: list[str]) -> ServeConfig:
    """What `inferd serve FLAGS` runs with (the CLI's own mapping)."""
    return config_from_args(build_parser().parse_args(["serve", *flags]), read_environment())


@dataclass
class App:
    url: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def completion(self, prompt: str) -> httpx.Response:
        body = {"model": "inferd-tiny", "prompt": prompt, "max_tokens": 2}
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=60)


def free_port() -> int:
    """A port free now; Serve's proxy takes no port 0 it would report, hence the retry below."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_serve(tries: int = 3) -> int:
    """Starts Ray Serve's HTTP proxy on a free loopback port and waits until Serve reports it
    healthy; returns the port. A port found free can be taken before the proxy binds it (Ray's own
    processes bind ephemeral ports too: seen once in CI as "Failed to bind to address"): only
    that failure is retried on another port. Anything else is a slow start, which Serve itself
    sees through (it restarts a proxy that failed): nothing is shut down while still starting."""
    for attempt in range(tries):
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
        except (ray.exceptions.RayError, TimeoutError) as e:
            if not _failed_to_bind(e):
                _wait_for_proxies()
                return port
            serve.shutdown()
            if attempt == tries - 1:
                raise
            continue
        _wait_for_proxies()
        return port
    raise AssertionError("not reached")


def _failed_to_bind(error: BaseException) -> bool:
    text = str(error).lower()
    return "bind" in text or "address already in use" in text


def _wait_for_proxies() -> None:
    """Until `serve.status()` lists every proxy HEALTHY."""
    deadline = time.monotonic() + START_DEADLINE_S
    while True:
        proxies = serve.status().proxies
        if proxies and all(s == ProxyStatus.HEALTHY for s in proxies.values()):
            return
        assert time.monotonic() < deadline, f"Serve's proxies never became healthy: {proxies}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def app() -> Iterator[App]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = _start_serve()
        options = RayServeOptions(config=serve_config(["inferd-tiny", *SMALL]), num_replicas=2)
        serve.run(build_app(options), name="inferd", route_prefix="/")
        yield App(f"http://127.0.0.1:{port}")
    finally:
        serve.shutdown()
        ray.shutdown()


def test_completions_and_chat_through_the_openai_client(app: App) -> None:
    with app.client() as client:  # closed: its pooled sockets must not reach the GC
        done = client.completions.create(
            model="inferd-tiny", prompt="Once upon", max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert done.choices[0].text and done.usage is not None
        assert done.usage.completion_tokens == 3
        chat = client.chat.completions.create(
            model="inferd-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.choices[0].message.role == "assistant"
        assert [m.id for m in client.models.list().data] == ["inferd-tiny"]


def test_a_stream_arrives_chunk_by_chunk(app: App) -> None:
    with app.client() as client:
        stream = client.chat.completions.create(
            model="inferd-tiny",
            messages=[{"role": "user", "content": "tell me a story"}],
            # Several chunks even if a slow reader gets merged deltas (engine/streams.py).
            max_tokens=64,
            stream=True,
            extra_body={"ignore_eos": True},  # the tiny model's EOS would end it early
        )
        chunks = list(stream)
    assert len(chunks) >= 3  # role, tokens (several at once only if detokenizing holds some)
    assert chunks[-1].choices[0].finish_reason == "length"
    # The last event carries the timings, with the router's stage first.
    timings = (chunks[-1].model_extra or {})["timings"]
    assert next(iter(timings)) == "route" and timings["route"] >= 0


def test_requests_sharing_a_prefix_land_on_one_replica(app: App) -> None:
    first = [app.completion(PREFIX + f"Question {i}: what happened?") for i in range(4)]
    other = app.completion("Unrelated topic number two, about rivers and lakes. " * 3)
    assert all(r.status_code == 200 for r in [*first, other])
    homes = {r.headers[REPLICA] for r in first}
    assert len(homes) == 1
    # The replica really held the prefix: its engine reports the cached tokens.
    assert first[-1].json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    # The route stage, as `inferd router` gives it: first in timings, and the index's estimate.
    assert next(iter(first[-1].json()["timings"])) == "route"
    assert int(first[-1].headers["x-inferd-route-cached-tokens"]) >= 32
    # A new prefix group goes to the replica holding less, not to the warm one.
    assert other.headers[REPLICA] not in homes


def test_the_request_routers_metrics_are_served_by_the_ingress(app: App) -> None:
    # Its own requests (it passes alone too): a new prefix goes cold, its second use hits.
    prefix = "The harbour ledger lists every ship that entered the bay in the first winter. " * 3
    sent = [app.completion(prefix + f"Entry {i}.") for i in range(2)]
    assert all(r.status_code == 200 for r in sent)
    text = httpx.get(f"{app.url}/router/metrics", timeout=30).text
    routed = [
        line for line in text.splitlines() if line.startswith("inferd_router_requests_total{")
    ]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in routed) >= 2
    assert 'outcome="cache_hit"' in text and 'outcome="cold"' in text
    assert "inferd_router_decision_seconds_count" in text
    assert "inferd_router_load_tokens{" in text


def test_the_replicas_block_digests_reach_the_router_with_their_routing_stats(app: App) -> None:
    # Serve polls each replica's record_routing_stats every 2 s (RayServeOptions); a digest
    # holding this prefix resets that replica's index, which still matches the prefix.
    prefix = "The lighthouse keeper wrote down every storm of the long autumn. " * 3
    first = app.completion(prefix + "The first storm.")
    assert first.status_code == 200
    home = first.headers[REPLICA]
    applied = f'inferd_router_replica_digests_total{{replica="{home}",result="applied"}}'
    # Two more digests applied: the second was taken at a poll after the first one's, so after
    # this request's prefill. The router applies digests as it routes (it reads the replicas'
    # routing stats then): unrelated requests let it, one per Serve poll.
    target = _metric(app, applied) + 2
    deadline = time.monotonic() + 60
    for i in itertools.count():
        if _metric(app, applied) >= target:
            break
        assert time.monotonic() < deadline, "no two digests were applied in 60 s"
        assert app.completion(f"Filler {i}, about the weather in the hills.").status_code == 200
        time.sleep(0.5)
    again = app.completion(prefix + "The second storm.")
    assert again.headers[REPLICA] == home
    assert int(again.headers["x-inferd-route-cached-tokens"]) >= 32


def _metric(app: App, name: str) -> float:
    text = httpx.get(f"{app.url}/router/metrics", timeout=30).text
    return parse_samples(text).get(name, 0.0)


def test_bad_input_gets_the_replicas_own_400(app: App) -> None:
    r = httpx.post(f"{app.url}/v1/completions", json={"prompt": 3}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_killed_replica_actor_leaves_rotation_and_costs_no_later_request(app: App) -> None:
    # Last in the file: it kills one engine replica (Serve starts a new one in the background).
    engines = [
        a for a in ray.util.list_named_actors(all_namespaces=True) if "#inferd-engine#" in a["name"]
    ]
    assert len(engines) == 2
    victim = engines[0]["name"]
    ray.kill(ray.get_actor(victim, namespace=engines[0]["namespace"]), no_restart=True)
    answers = [app.completion(f"After the kill, request {i}. " * 4) for i in range(8)]
    assert [r.status_code for r in answers] == [200] * 8
    assert all(r.headers[REPLICA] != victim for r in answers)
    text = httpx.get(f"{app.url}/router/metrics", timeout=30).text
    assert f'inferd_router_ejections_total{{reason="actor_died",replica="{victim}"}} 1.0' in text
