"""The router's dashboard overview: replica states, load, routed counts and both hit rates over a
window (differences of two counter snapshots), outcomes and the decision-time quantiles."""

from __future__ import annotations

import pytest

from inferd.router.cluster import Cluster
from inferd.router.config import RouterConfig
from inferd.router.load import ReplicaReport
from inferd.router.metrics import RouterMetrics
from inferd.router.overview import History, Totals, overview, quantile

A, B, C, D = "http://a", "http://b", "http://c", "http://d"
INF = float("inf")


def make() -> tuple[Cluster, RouterMetrics]:
    cluster = Cluster(RouterConfig(replicas=(A, B, C, D)))
    return cluster, RouterMetrics(cluster)


def answered(m: RouterMetrics, url: str, outcome: str, prompt: int, cached: int) -> None:
    """What the proxy counts for a request a replica answered."""
    m.requests.labels(url, outcome).inc()
    m.prompt_tokens.labels(url).inc(prompt)
    m.cached_tokens.labels(url).inc(cached)
    m.decision.observe(0.0002)


def rows(doc: dict[str, object]) -> dict[str, dict[str, object]]:
    replicas = doc["replicas"]
    assert isinstance(replicas, list)
    return {r["url"]: r for r in replicas}


def test_quantile_interpolates_inside_its_bucket() -> None:
    buckets = ((0.001, 2.0), (0.01, 4.0), (INF, 4.0))
    assert quantile(0.5, buckets) == 0.001
    assert quantile(0.75, buckets) == pytest.approx(0.0055)
    assert quantile(0.5, ((0.001, 0.0), (INF, 0.0))) is None
    assert quantile(0.5, ()) is None
    # Beyond the last finite bound: reported as that bound, not infinity.
    assert quantile(0.99, ((0.001, 1.0), (INF, 10.0))) == 0.001


def test_states_load_and_in_flight_come_from_the_cluster() -> None:
    cluster, m = make()
    cluster.set_health(A, ready=True)
    cluster.set_health(B, ready=True)
    cluster.set_health(B, ready=False, reason="draining")
    cluster.set_health(C, ready=True)
    cluster.failed(C, "connect_error")
    cluster.report(A, ReplicaReport(running=2, queued_prompt_tokens=100, kv_cache_usage=0.25))
    ticket = cluster.dispatch(A, cluster.route(list(range(40))))

    doc = overview(cluster, Totals.read(m, cluster, 1.0), Totals(0.0), 60.0)
    by = rows(doc)
    assert [by[u]["state"] for u in (A, B, C, D)] == ["healthy", "draining", "ejected", "unknown"]
    assert by[C]["reason"] == "connect_error" and by[C]["ejections_total"] == 1
    assert by[A]["in_flight"] == 1 and by[B]["in_flight"] == 0
    # The larger of the router's view (40 pending + 32 * 1) and the replica's (100 + 32 * 2).
    assert by[A]["load_tokens"] == 164 == cluster.load_tokens(cluster.replicas[A])
    assert by[A]["router_load"] == {"prefill_tokens": 40, "in_flight": 1, "image_work": 0}
    assert by[A]["reported_load"] == {
        "running": 2,
        "waiting": 0,
        "queued_prompt_tokens": 100,
        "kv_cache_usage": 0.25,
    }
    assert by[A]["dashboard"] == "http://a/dashboard"
    assert doc["replicas_ready"] == 1 and doc["policy"] == "cache_aware"
    ticket.finish()
    at_rest = rows(overview(cluster, Totals.read(m, cluster, 2.0), Totals(0.0), 60.0))
    assert at_rest[A]["in_flight"] == 0


def test_counts_and_hit_rates_are_over_the_window() -> None:
    cluster, m = make()
    for url in (A, B):
        cluster.set_health(url, ready=True)
    answered(m, A, "cold", 100, 0)
    cluster.report(A, ReplicaReport(prefix_queries_tokens=100, prefix_hits_tokens=0))
    start = Totals(0.0)
    before = Totals.read(m, cluster, 10.0)
    for _ in range(3):
        answered(m, A, "cache_hit", 100, 80)
    answered(m, B, "cold", 50, 0)
    m.retries.labels("connect_error").inc()
    cluster.report(A, ReplicaReport(prefix_queries_tokens=400, prefix_hits_tokens=270))
    now = Totals.read(m, cluster, 20.0)

    windowed = overview(cluster, now, before, 60.0)
    by = rows(windowed)
    assert (by[A]["routed"], by[A]["routed_total"], by[B]["routed"]) == (3, 4, 1)
    assert by[A]["outcomes"] == {"cache_hit": 3}
    assert by[A]["estimated_hit_rate"] == 0.8
    assert by[A]["replica_hit_rate"] == 0.9  # (270 - 0) / (400 - 100)
    assert by[B]["estimated_hit_rate"] == 0.0 and by[B]["replica_hit_rate"] is None
    assert windowed["requests"] == 4 and windowed["rps"] == 0.4 and windowed["span_s"] == 10.0
    assert windowed["outcomes"] == {"cache_hit": 3, "cold": 1}
    assert windowed["retries"] == {"connect_error": 1}
    decision = windowed["decision"]
    assert isinstance(decision, dict) and 0.0001 < decision["p50"] <= 0.00025

    # From the router's start: every request, the replica's counters since it started.
    whole = rows(overview(cluster, now, start, 60.0))
    assert whole[A]["routed"] == 4 and whole[A]["estimated_hit_rate"] == 0.6
    assert whole[A]["replica_hit_rate"] == 0.675


def test_no_traffic_reads_as_nothing_not_zero_division() -> None:
    cluster, m = make()
    doc = overview(cluster, Totals.read(m, cluster, 5.0), Totals(5.0), 60.0)
    assert doc["rps"] == 0.0 and doc["outcomes"] == {} and doc["requests"] == 0
    assert doc["decision"] == {"p50": None, "p99": None}
    assert all(r["estimated_hit_rate"] is None for r in rows(doc).values())


def test_history_answers_from_the_windows_start_and_stays_bounded() -> None:
    history = History(Totals(0.0), keep_s=100.0, every_s=1.0)
    assert history.before(-50.0).at == 0.0  # younger than the window: since the start
    for t in (0.5, 1.0, 1.2, 30.0, 60.0):
        history.add(Totals(t))
    assert [t.at for t in history.kept] == [0.0, 1.0, 30.0, 60.0]  # at most one a second
    assert history.before(45.0).at == 30.0 and history.before(10.0).at == 1.0
    # A page opened long after the traffic still reaches back to the window's start.
    history.add(Totals(500.0))
    assert [t.at for t in history.kept] == [60.0, 500.0]
    assert history.before(500.0 - 60.0).at == 60.0
