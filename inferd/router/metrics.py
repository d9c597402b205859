"""The router's /metrics: what it decided, how fast, where load sits, what failed.

inferd_router_requests_total{replica, outcome}   routed requests (outcome: cache_hit, spill,
                                                 cold, least_load, power_of_two, round_robin,
                                                 passthrough for requests that are not routed
                                                 on a prompt)
inferd_router_decision_seconds                   tokenize + match + policy, per request
inferd_router_prompt_tokens_total{replica}       prompt tokens routed
inferd_router_estimated_cached_tokens_total{replica}  of those, what the index expected cached
inferd_router_retries_total{reason}              tries moved to another replica
inferd_router_ejections_total{replica, reason}   a replica taken out of rotation
inferd_router_no_replica_total                   503s for want of a ready replica
inferd_router_kv_events_total{replica, kind}     KV events applied to the exact index (kind:
                                                 stored, removed), with --replica-kv-events
inferd_router_kv_event_gaps_total{replica}       gaps in a replica's KV events: its exact index
                                                 was dropped and rebuilds from what follows
inferd_router_index_stale_blocks_total{replica}  blocks dropped from the approximate index because
                                                 the replica's reported cached tokens, or its
                                                 block digest, showed them evicted
inferd_router_replica_digests_total{replica, result}  block digests read with the health checks
                                                 (result: applied; failed: no answer or not 200;
                                                 unsupported: 401/403/404, not asked again)
inferd_router_replica_ready{replica}             1 in rotation, 0 out (at scrape time)
inferd_router_in_flight{replica}                 requests the router has there (at scrape time)
inferd_router_load_tokens{replica}               the policy's load estimate (at scrape time)
inferd_router_image_work{replica}                latent pixel-steps of image requests in flight
inferd_router_index_blocks{replica}              prefix index size (at scrape time)
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inferd.router.cluster import Cluster, Routed

DECISION_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1)


class _ClusterCollector(Collector):
    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster

    def collect(self) -> Iterator[Metric]:
        c = self._cluster
        families = (
            ("inferd_router_replica_ready", "1 when the replica is in rotation", lambda r: r.ready),
            ("inferd_router_in_flight", "Requests in flight there", lambda r: r.load.in_flight),
            ("inferd_router_load_tokens", "Load estimate in tokens", c.load_tokens),
            (
                "inferd_router_image_work",
                "Latent pixel-steps of the image requests in flight there",
                lambda r: r.load.image_work,
            ),
            ("inferd_router_index_blocks", "Prefix index blocks", lambda r: c.index.size(r.url)),
        )
        for name, help_text, value in families:
            family = GaugeMetricFamily(name, help_text, labels=["replica"])
            for replica in c.replicas.values():
                family.add_metric([replica.url], float(value(replica)))
            yield family
        # The replicas' own counters as last scraped: the real hit rate beside the estimate.
        for name, help_text, field in (
            ("inferd_router_replica_prefix_cache_queries_tokens", "Replica-reported", "queries"),
            ("inferd_router_replica_prefix_cache_hits_tokens", "Replica-reported", "hits"),
        ):
            counter = CounterMetricFamily(
                name, f"{help_text} prefix-cache {field} (tokens)", labels=["replica"]
            )
            for replica in c.replicas.values():
                r = replica.load.report
                total = r.prefix_queries_tokens if field == "queries" else r.prefix_hits_tokens
                counter.add_metric([replica.url], float(total))
            yield counter


class RouterMetrics:
    def __init__(self, cluster: Cluster) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "inferd_router_requests", "Routed requests", ["replica", "outcome"], registry=r
        )
        self.decision = Histogram(
            "inferd_router_decision_seconds",
            "Routing decision time (tokenize, prefix match, policy)",
            registry=r,
            buckets=DECISION_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "inferd_router_prompt_tokens", "Prompt tokens routed", ["replica"], registry=r
        )
        self.cached_tokens = Counter(
            "inferd_router_estimated_cached_tokens",
            "Prompt tokens the prefix index expected cached",
            ["replica"],
            registry=r,
        )
        self.retries = Counter(
            "inferd_router_retries", "Tries moved to another replica", ["reason"], registry=r
        )
        self.ejections = Counter(
            "inferd_router_ejections",
            "Replicas taken out of rotation",
            ["replica", "reason"],
            registry=r,
        )
        self.no_replica = Counter(
            "inferd_router_no_replica", "Requests refused: no replica ready", registry=r
        )
        self.kv_events = Counter(
            "inferd_router_kv_events",
            "KV events applied to the exact prefix index",
            ["replica", "kind"],
            registry=r,
        )
        self.kv_event_gaps = Counter(
            "inferd_router_kv_event_gaps",
            "Gaps in a replica's KV events (its exact index dropped)",
            ["replica"],
            registry=r,
        )
        self.stale_blocks = Counter(
            "inferd_router_index_stale_blocks",
            "Prefix index blocks dropped: the replica's reported cached tokens or its block digest "
            "showed them evicted",
            ["replica"],
            registry=r,
        )
        self.digests = Counter(
            "inferd_router_replica_digests",
            "Replica block digests read (GET /v1/kv_cache/blocks)",
            ["replica", "result"],
            registry=r,
        )
        r.register(_ClusterCollector(cluster))

    def digest_applied(self, url: str, gone: int) -> None:
        """A replica's block digest reset its index; `gone`: claimed blocks it lacked."""
        if gone:
            self.stale_blocks.labels(url).inc(gone)
        self.digests.labels(url, "applied").inc()

    def count(self, url: str, routed: Routed) -> None:
        """One request sent to `url` on this decision (`passthrough`: not routed on a prompt)."""
        outcome = routed.decision.outcome if routed.prompt_tokens else "passthrough"
        self.requests.labels(url, outcome).inc()
        if routed.prompt_tokens:
            self.prompt_tokens.labels(url).inc(routed.prompt_tokens)
            self.cached_tokens.labels(url).inc(routed.decision.cached_tokens)
