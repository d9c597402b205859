"""Active health checks and replica discovery, once per interval.

Each interval: re-resolve `--replica-dns` (every address it gives is a replica, as a Kubernetes
headless Service lists pods), then GET each replica's `/health/ready` (200: in rotation; 503
`loading`/`draining`/`engine_dead` or no answer: out) and, for a ready one, its `/metrics` for the
engine's own load gauges, prefix-cache counters and cache settings (`inferd_cache_config_info`:
a replica's index is bounded by its number of KV blocks; a block size other than the router's is
logged, since no block would ever match), then its block digest (`GET /v1/kv_cache/blocks`,
gateway/kv_cache.py), which resets the replica's approximate prefix index to what its cache
holds (router/index.py, `snapshot`), and its model list (`GET /v1/models`), whose entries with a
`parent` are the LoRA adapters it serves (router/adapters.py). A replica that answers the digest
with 401, 403 or 404 (API keys and no `--replica-api-key`, or an older inferd) is not asked
again; its index stays the router's own estimate. Replicas followed by KV events are not asked:
their index is exact. Large replicas' digests are asked for less often than every check
(router/digest_pacer.py).
Passive checks (a connect error or 5xx while forwarding) live in the proxy and eject a replica at
once, without waiting for the next interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import time

import httpx
import orjson

from inferd.kv_cache.block_hash import BLOCK_HASH_SEED
from inferd.kv_cache.prefix_cache import BlockDigest
from inferd.router.adapters import served_models
from inferd.router.cluster import Cluster
from inferd.router.digest_pacer import DigestPacer
from inferd.router.load import ReplicaReport
from inferd.router.metrics import RouterMetrics
from inferd.telemetry.metrics import parse_samples

logger = logging.getLogger("inferd.router")

# Replica sample -> ReplicaReport field (inferd.telemetry.metrics names them).
_SAMPLES = {
    "inferd_num_requests_running": "running",
    "inferd_num_requests_waiting": "waiting",
    "inferd_num_requests_queued": "queued",
    "inferd_queued_prompt_tokens": "queued_prompt_tokens",
    "inferd_prefix_cache_queries_tokens_total": "prefix_queries_tokens",
    "inferd_prefix_cache_hits_tokens_total": "prefix_hits_tokens",
}
_CACHE_INFO = "inferd_cache_config_info{"
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def report_from_metrics(text: str) -> ReplicaReport:
    """The load gauges, prefix-cache counters and cache settings of a replica's /metrics page
    (absent ones stay 0 / None)."""
    samples = parse_samples(text)
    counts = {f: int(samples[name]) for name, f in _SAMPLES.items() if name in samples}
    info: dict[str, str] = {}
    for key in samples:
        if key.startswith(_CACHE_INFO):
            info = dict(_LABEL.findall(key))
    return ReplicaReport(
        **counts,
        kv_cache_usage=samples.get("inferd_kv_cache_usage_ratio", 0.0),
        block_size=_int(info.get("block_size")),
        num_blocks=_int(info.get("num_blocks")),
    )


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


async def resolve(dns_name: str) -> list[str]:
    """`host:port` -> one `http://ip:port` per address the name has now."""
    host, _, port = dns_name.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--replica-dns wants HOST:PORT, got {dns_name!r}")
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    hosts = sorted({str(info[4][0]) for info in infos})
    return [f"http://[{h}]:{port}" if ":" in h else f"http://{h}:{port}" for h in hosts]


class HealthChecker:
    def __init__(self, cluster: Cluster, client: httpx.AsyncClient, metrics: RouterMetrics) -> None:
        self.cluster = cluster
        self.client = client
        self.metrics = metrics
        self._task: asyncio.Task[None] | None = None
        self._warned: set[str] = set()
        # Replicas that refused the digest (401/403/404): not asked again.
        self._no_digest: set[str] = set()
        self.digests = DigestPacer(cluster.config.health_interval_s)

    async def check_all(self) -> None:
        cfg = self.cluster.config
        if cfg.dns_name is not None:
            try:
                found = await resolve(cfg.dns_name)
            except OSError as e:
                logger.warning("resolving %s: %s (keeping the last replica set)", cfg.dns_name, e)
            else:
                self.cluster.set_members([*cfg.replicas, *found])
        await asyncio.gather(*(self.check(url) for url in self.cluster.names()))

    async def check(self, url: str) -> None:
        timeout = self.cluster.config.health_timeout_s
        try:
            ready = await self.client.get(f"{url}/health/ready", timeout=timeout)
        except httpx.HTTPError as e:
            self.eject(url, "unreachable", repr(e))
            return
        if ready.status_code != 200:
            self.eject(url, _reason(ready), ready.text[:200])
            return
        self.cluster.set_health(url, ready=True)
        with contextlib.suppress(httpx.HTTPError, ValueError):
            page = await self.client.get(f"{url}/metrics", timeout=timeout)
            report = report_from_metrics(page.text)
            self.cluster.report(url, report)
            self._check_block_size(url, report)
        await self.read_models(url)
        await self.read_digest(url)

    async def read_models(self, url: str) -> None:
        """The replica's model list into the adapter catalog; a failed or malformed answer
        keeps the last one."""
        with contextlib.suppress(httpx.HTTPError):
            answer = await self.client.get(
                f"{url}/v1/models",
                headers=self._auth(),
                timeout=self.cluster.config.health_timeout_s,
            )
            served = served_models(answer.content) if answer.status_code == 200 else None
            if served is not None:
                self.cluster.adapters.update(url, served)

    def _auth(self) -> dict[str, str] | None:
        key = self.cluster.config.replica_api_key
        return {"Authorization": f"Bearer {key}"} if key else None

    async def read_digest(self, url: str) -> None:
        """The replica's block digest into its prefix index (see the module docstring)."""
        cluster = self.cluster
        if (
            not cluster.config.replica_digest
            or url in self._no_digest
            or cluster.index.is_exact(url)
        ):
            return
        now = time.monotonic()
        if not self.digests.due(url, now):
            return
        since = cluster.digest_since(url)
        # Live: used within two digests (router/index.py: the share of the groups).
        params = {"limit": cluster.index.capacity(url), "recent_s": self.digests.recent_s(url)}
        try:
            answer = await self.client.get(
                f"{url}/v1/kv_cache/blocks",
                params=params,
                headers=self._auth(),
                timeout=cluster.config.health_timeout_s,
            )
        except httpx.HTTPError:
            self.metrics.digests.labels(url, "failed").inc()
            return
        if answer.status_code in (401, 403, 404):
            self._no_digest.add(url)
            self.metrics.digests.labels(url, "unsupported").inc()
            logger.warning(
                "replica %s answers its block digest with %d: its prefix index stays this "
                "router's estimate",
                url,
                answer.status_code,
            )
            return
        t0 = time.perf_counter()
        digest = _digest(answer, cluster.config.block_size)
        if digest is None:
            self.metrics.digests.labels(url, "failed").inc()
            return
        gone = cluster.digest(url, digest.hashes, since, digest.num_recent)
        self.metrics.digest_applied(url, gone)
        self.digests.applied(url, now, time.perf_counter() - t0, len(cluster.replicas))

    def _check_block_size(self, url: str, report: ReplicaReport) -> None:
        """A replica on another block size never matches a block: say so, once per replica."""
        ours = self.cluster.config.block_size
        if report.block_size not in (None, ours) and url not in self._warned:
            self._warned.add(url)
            logger.warning(
                "replica %s uses --block-size %s, the router %d: prefix matches will all miss",
                url,
                report.block_size,
                ours,
            )

    def eject(self, url: str, reason: str, detail: str = "") -> None:
        if self.cluster.failed(url, reason):
            self.metrics.ejections.labels(url, reason).inc()
            logger.warning("replica %s out of rotation: %s %s", url, reason, detail)

    async def run(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:
                logger.exception("health check round failed")
            await asyncio.sleep(self.cluster.config.health_interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def _digest(answer: httpx.Response, block_size: int) -> BlockDigest | None:
    """A 200 digest body in this router's hashing (block size and hash version), or None:
    another answer, another body, or hashes that could never match."""
    if answer.status_code != 200:
        return None
    with contextlib.suppress(ValueError):
        body = orjson.loads(answer.content)
        if not isinstance(body, dict) or body.get("block_size") != block_size:
            return None
        if body.get("hash_version") != BLOCK_HASH_SEED.decode():
            return None
        hashes, recent = body.get("block_hashes"), body.get("num_recent", 0)
        if not isinstance(hashes, list) or not all(type(h) is int for h in hashes):
            return None
        if type(recent) is int and 0 <= recent <= len(hashes):
            return BlockDigest(hashes, recent)
    return None


def _reason(response: httpx.Response) -> str:
    """`draining`, `loading`, ... from a replica's 503 readiness body, else `status_<code>`."""
    with contextlib.suppress(ValueError):
        body = response.json()
        if isinstance(body, dict) and isinstance(body.get("status"), str):
            return str(body["status"])
    return f"status_{response.status_code}"
