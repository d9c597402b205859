"""The routing benchmark's processes and what it reads from them: inferd-tiny replicas and
`inferd router` instances on loopback, their /metrics, a background sampler of the replicas'
prefix-cache counters (hit rate per time window), and killing a replica outright."""

from __future__ import annotations

import itertools
import math
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from router_workloads import BLOCK_SIZE
from serve import free_port, launched_server, proc_table, stop_server, wait_ready

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass(frozen=True)
class Replica:
    """One `inferd serve` child: its URL, its front process, and where it publishes KV events
    (None unless the run asked for them)."""

    url: str
    pid: int
    kv_events: str | None


def scrape(url: str) -> Samples:
    """Every sample of `url`/metrics: (name, sorted labels) -> value."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return out


def prefix_counters(url: str) -> tuple[float, float]:
    """(queried, hit) prompt tokens of one replica so far."""
    m = scrape(url)
    return (
        m.get(("inferd_prefix_cache_queries_tokens_total", ()), math.nan),
        m.get(("inferd_prefix_cache_hits_tokens_total", ()), math.nan),
    )


def in_flight(router: str, replica: str) -> float:
    """The requests `router` has in flight on `replica` right now."""
    return scrape(router).get(("inferd_router_in_flight", (("replica", replica),)), 0.0)


def replica_num_blocks(url: str) -> int | None:
    for (name, labels), _ in scrape(url).items():
        if name == "inferd_cache_config_info":
            return int(dict(labels)["num_blocks"])
    return None


def router_stats(urls: Sequence[str]) -> dict[str, Any]:
    """The routers' view of the cell, summed over them: requests by "replica|outcome", retries,
    and the estimated hit rate (the tokens their indexes expected cached / the prompt tokens
    they routed)."""
    outcomes: dict[str, float] = {}
    retries = 0.0
    prompt = cached = 0.0
    for url in urls:
        for (name, labels), value in scrape(url).items():
            if name == "inferd_router_requests_total":
                d = dict(labels)
                key = f"{d.get('replica')}|{d.get('outcome')}"
                outcomes[key] = outcomes.get(key, 0.0) + value
            elif name == "inferd_router_retries_total":
                retries += value
            elif name == "inferd_router_prompt_tokens_total":
                prompt += value
            elif name == "inferd_router_estimated_cached_tokens_total":
                cached += value
    return {
        "requests": outcomes,
        "retries": retries,
        "estimated_hit_rate": cached / prompt if prompt else math.nan,
    }


@contextmanager
def launched_replicas(
    n: int, server_args: list[str], log_dir: Path, kv_events: bool
) -> Iterator[list[Replica]]:
    """N `inferd serve` replicas until the block ends; with `kv_events` each publishes its KV
    events on its own loopback ZeroMQ endpoint."""
    with ExitStack() as stack:
        replicas = []
        for i in range(n):
            endpoint = f"tcp://127.0.0.1:{free_port()}" if kv_events else None
            extra = ["--kv-events-endpoint", endpoint] if endpoint else []
            log = log_dir / f"replica{i}.log"
            server = stack.enter_context(launched_server([*server_args, *extra], log))
            replicas.append(Replica(server.url, server.pid, endpoint))
        yield replicas


def router_command(
    replicas: Sequence[Replica], policy: str, port: int, exact: bool, flags: Sequence[str] = ()
) -> list[str]:
    """`inferd router` over `replicas` with `flags` added; `exact` follows their KV events
    instead of indexing its own decisions."""
    exe = Path(sys.executable).parent / "inferd"
    cmd = [str(exe), "router", "--port", str(port), "--policy", policy, "--seed", "0", *flags]
    cmd += ["--block-size", str(BLOCK_SIZE)]
    for r in replicas:
        cmd += ["--replica", r.url]
        if exact:
            if r.kv_events is None:
                raise ValueError("an exact index needs replicas started with KV events")
            cmd += ["--replica-kv-events", f"{r.url}={r.kv_events}"]
    return cmd


def peer_command(template: str, replicas: Sequence[Replica], port: int) -> list[str]:
    """A peer router's command line: `{port}` filled in, and a `{workers}` word replaced by
    the replicas' URLs, one word each.

    >>> peer_command("r --port {port} --worker-urls {workers}", [Replica("http://a", 1, None)], 9)
    ['r', '--port', '9', '--worker-urls', 'http://a']
    """
    cmd: list[str] = []
    for word in shlex.split(template):
        if word == "{workers}":
            cmd += [r.url for r in replicas]
        else:
            cmd.append(word.replace("{port}", str(port)))
    return cmd


@contextmanager
def launched_router(
    replicas: Sequence[Replica],
    policy: str,
    log_path: Path,
    exact: bool,
    peer: str | None = None,
    flags: Sequence[str] = (),
) -> Iterator[str]:
    """A fresh router (an empty index) over `replicas` until the block ends: `inferd router`
    (with `flags` added), or the `peer` command line (ready when its /health answers 200)."""
    port = free_port()
    if peer is None:
        cmd = router_command(replicas, policy, port, exact, flags)
    else:
        cmd = peer_command(peer, replicas, port)
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_ready(f"{base}/health/ready" if peer is None else f"{base}/health", proc)
            if exact:
                time.sleep(0.5)  # ZeroMQ's slow joiner: subscriptions connect after readiness
            yield base
        finally:
            stop_server(proc)


def kill_replica(replica: Replica) -> None:
    """SIGKILL the replica's front and its engine core: no drain, no goodbye."""
    children = [pid for pid, (ppid, _) in proc_table().items() if ppid == replica.pid]
    for pid in [replica.pid, *children]:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@dataclass
class CounterSampler:
    """Scrapes every replica's prefix-cache counters each `interval` seconds on a thread. A
    replica that does not answer (killed) keeps its last values, so its deltas are 0 after."""

    urls: list[str]
    interval: float = 1.0
    # (seconds since start, [(queried, hit) per replica])
    samples: list[tuple[float, list[tuple[float, float]]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _start: float = 0.0

    def start(self, t0: float) -> None:
        self._start = t0
        self._sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        last = self.samples[-1][1] if self.samples else [(0.0, 0.0)] * len(self.urls)
        values = []
        for url, previous in zip(self.urls, last, strict=True):
            try:
                values.append(prefix_counters(url))
            except httpx.HTTPError:
                values.append(previous)
        self.samples.append((time.perf_counter() - self._start, values))

    def window_hit_rates(self, edges: Sequence[float]) -> list[float]:
        """The cluster's hit rate between consecutive `edges` (seconds since start): the
        counters' deltas between the samples nearest each edge."""
        out = []
        for lo, hi in itertools.pairwise(edges):
            a, b = self._at(lo), self._at(hi)
            queried = sum(y[0] - x[0] for x, y in zip(a, b, strict=True))
            hit = sum(y[1] - x[1] for x, y in zip(a, b, strict=True))
            out.append(hit / queried if queried > 0 else math.nan)
        return out

    def _at(self, t: float) -> list[tuple[float, float]]:
        return min(self.samples, key=lambda s: abs(s[0] - t))[1]
