"""The router's dashboard overview: each replica's state, load and hit rates, and the router's
own rates, over the recent window.

Nothing new is counted for it: a snapshot reads the cluster's live bookkeeping (state, in-flight,
load parts, index size, the replicas' scraped reports) and the router's Prometheus counters
(`RouterMetrics`). Counters are cumulative, so a window's rates are the difference of two
`Totals`: now and the one `History` kept from the window's start (the router's start while it is
younger than the window), computed only for an open page, once per tick.

    {"window_s": 60, "span_s": 59.8, "policy": "cache_aware", "rps": 4.1,
     "decision": {"p50": 0.0002, "p99": 0.0009}, "outcomes": {"cache_hit": 200, "cold": 46},
     "retries": {"connect_error": 1}, "no_replica": 0,
     "replicas": [{"url": "http://a:8000", "state": "healthy", "in_flight": 3,
                   "load_tokens": 1120, "routed": 120, "estimated_hit_rate": 0.81,
                   "replica_hit_rate": 0.78, ...}]}

Estimated vs replica-reported hit rate: the first is what the router's prefix index expected
cached of the prompts it sent there; the second is the replica's own prefix-cache counters
(`inferd_prefix_cache_{queries,hits}_tokens_total`, scraped each health interval), which also
cover traffic other routers sent. A persistent gap means the index is wrong (block size, capacity).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.metrics import MetricWrapperBase

from inferd.router.cluster import Cluster, Replica
from inferd.router.metrics import RouterMetrics

QUANTILES = (50, 99)


@dataclass(frozen=True)
class Totals:
    """The router's cumulative counters at one instant (monotonic seconds `at`)."""

    at: float
    # (replica, outcome) -> answered requests; outcome `passthrough` for unrouted ones.
    requests: Mapping[tuple[str, str], float] = field(default_factory=dict)
    prompt_tokens: Mapping[str, float] = field(default_factory=dict)
    cached_tokens: Mapping[str, float] = field(default_factory=dict)
    retries: Mapping[str, float] = field(default_factory=dict)
    no_replica: float = 0.0
    # The decision-time histogram: (upper bound, cumulative count), +Inf last.
    decision: tuple[tuple[float, float], ...] = ()
    # The replicas' own prefix-cache token counters as last scraped: url -> (queries, hits).
    replica_prefix: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def read(cls, metrics: RouterMetrics, cluster: Cluster, at: float) -> Totals:
        reports = {url: r.load.report for url, r in cluster.replicas.items()}
        return cls(
            at,
            requests={(s["replica"], s["outcome"]): v for s, v in _totals(metrics.requests)},
            prompt_tokens={s["replica"]: v for s, v in _totals(metrics.prompt_tokens)},
            cached_tokens={s["replica"]: v for s, v in _totals(metrics.cached_tokens)},
            retries={s["reason"]: v for s, v in _totals(metrics.retries)},
            no_replica=sum(v for _, v in _totals(metrics.no_replica)),
            decision=_buckets(metrics.decision),
            replica_prefix={
                url: (r.prefix_queries_tokens, r.prefix_hits_tokens) for url, r in reports.items()
            },
        )


class History:
    """Totals at most one per `every_s` seconds over the last `keep_s`, shared by every reader, so
    a page opened after the traffic still sees its window (not only what came after it opened).

    The oldest kept is the router's start until `keep_s` has passed, and then the latest one at or
    before `now - keep_s`: `before(t)` can always answer with a Totals from no later than `t` when
    one exists, so a window's span is at least the window once the router is old enough.
    """

    def __init__(self, start: Totals, keep_s: float = 3600.0, every_s: float = 1.0) -> None:
        self.kept: deque[Totals] = deque([start])
        self.keep_s, self.every_s = keep_s, every_s

    def add(self, now: Totals) -> None:
        if now.at - self.kept[-1].at >= self.every_s:
            self.kept.append(now)
        while len(self.kept) >= 2 and self.kept[1].at <= now.at - self.keep_s:
            self.kept.popleft()

    def before(self, at: float) -> Totals:
        """The latest Totals taken at or before `at`, else the oldest kept."""
        best = self.kept[0]
        for totals in self.kept:  # oldest first; a few thousand at most, once per tick
            if totals.at > at:
                break
            best = totals
        return best


def _totals(metric: MetricWrapperBase) -> Iterable[tuple[dict[str, str], float]]:
    """A counter's `_total` samples as (labels, value)."""
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                yield sample.labels, sample.value


def _buckets(metric: MetricWrapperBase) -> tuple[tuple[float, float], ...]:
    return tuple(
        (float(sample.labels["le"]), sample.value)
        for family in metric.collect()
        for sample in family.samples
        if sample.name.endswith("_bucket")
    )


def quantile(q: float, buckets: tuple[tuple[float, float], ...]) -> float | None:
    """The q-quantile (0..1) of a cumulative histogram, interpolated inside its bucket as
    Prometheus' `histogram_quantile` does; None without observations. A quantile in the +Inf
    bucket is reported as the largest finite bound.

    >>> quantile(0.5, ((0.001, 2.0), (0.01, 4.0), (float("inf"), 4.0)))
    0.001
    """
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank and count > below:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = (upper if upper != float("inf") else lower), count
    return lower


def _since(newest: Mapping[str, float], oldest: Mapping[str, float], key: str) -> float:
    return newest.get(key, 0.0) - oldest.get(key, 0.0)


def _ratio(part: float, whole: float) -> float | None:
    return round(min(max(part / whole, 0.0), 1.0), 4) if whole > 0 else None


_STATES = {"draining": "draining", "not checked yet": "unknown"}


def replica_state(replica: Replica) -> str:
    """healthy (in rotation), draining, unknown (not checked yet) or ejected (any other reason:
    `reason` says which)."""
    return "healthy" if replica.ready else _STATES.get(replica.reason, "ejected")


def _replica(cluster: Cluster, r: Replica, newest: Totals, oldest: Totals) -> dict[str, object]:
    url = r.url
    mine = {key: n for key, n in newest.requests.items() if key[0] == url}
    outcomes = {key[1]: n - oldest.requests.get(key, 0.0) for key, n in mine.items()}
    queries, hits = newest.replica_prefix.get(url, (0, 0))
    q0, h0 = oldest.replica_prefix.get(url, (0, 0))
    if queries > q0:  # a window's difference, else the counters since the replica started
        queries, hits = queries - q0, hits - h0
    report = r.load.report
    return {
        "url": url,
        "dashboard": f"{url}/dashboard",
        "state": replica_state(r),
        "reason": r.reason,
        "in_flight": r.load.in_flight,
        "load_tokens": cluster.load_tokens(r),
        # The two views the load is the larger of (router/load.py).
        "router_load": {
            "prefill_tokens": r.load.prefill_tokens,
            "in_flight": r.load.in_flight,
            "image_work": r.load.image_work,
        },
        "reported_load": {
            "running": report.running,
            "waiting": report.waiting + report.queued,
            "queued_prompt_tokens": report.queued_prompt_tokens,
            "kv_cache_usage": round(report.kv_cache_usage, 4),
        },
        "index_blocks": cluster.index.size(url),
        # True: the index follows the replica's KV events (router/kv_events.py), not estimates.
        "index_exact": cluster.index.is_exact(url),
        "routed": round(sum(outcomes.values())),
        "routed_total": round(sum(mine.values())),
        "outcomes": {o: round(n) for o, n in sorted(outcomes.items()) if n > 0},
        "ejections_total": r.ejections,
        "estimated_hit_rate": _ratio(
            _since(newest.cached_tokens, oldest.cached_tokens, url),
            _since(newest.prompt_tokens, oldest.prompt_tokens, url),
        ),
        "replica_hit_rate": _ratio(hits, queries),
    }


def overview(
    cluster: Cluster, newest: Totals, oldest: Totals, window_s: float
) -> dict[str, object]:
    """One snapshot: `oldest` is the reader's oldest Totals inside the window (or the router's
    start), so counts and rates cover `span_s` = newest.at - oldest.at seconds."""
    span = max(newest.at - oldest.at, 1e-9)
    outcomes: dict[str, float] = {}
    for key, n in newest.requests.items():
        outcomes[key[1]] = outcomes.get(key[1], 0.0) + n - oldest.requests.get(key, 0.0)
    decisions = _bucket_delta(newest.decision, oldest.decision)
    return {
        "time": time.time(),
        "window_s": window_s,
        "span_s": round(span, 3),
        "policy": cluster.policy.name,
        "replicas_ready": len(cluster.ready()),
        "requests": round(sum(outcomes.values())),
        "rps": round(sum(outcomes.values()) / span, 3),
        "decision": {f"p{q}": _round(quantile(q / 100, decisions)) for q in QUANTILES},
        "outcomes": {o: round(n) for o, n in sorted(outcomes.items()) if n > 0},
        "retries": {
            k: round(_since(newest.retries, oldest.retries, k))
            for k in sorted(newest.retries)
            if _since(newest.retries, oldest.retries, k) > 0
        },
        "no_replica": round(newest.no_replica - oldest.no_replica),
        "replicas": [_replica(cluster, r, newest, oldest) for r in cluster.replicas.values()],
    }


def _bucket_delta(
    newest: tuple[tuple[float, float], ...], oldest: tuple[tuple[float, float], ...]
) -> tuple[tuple[float, float], ...]:
    before = dict(oldest)
    return tuple((le, n - before.get(le, 0.0)) for le, n in newest)


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 7)
