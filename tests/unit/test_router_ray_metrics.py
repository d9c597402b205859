"""The Ray path's router metrics slot (router/ray_metrics.py), without ray."""

from __future__ import annotations

from inferd.router.cluster import Cluster
from inferd.router.config import RouterConfig
from inferd.router.ray_metrics import MetricsSlot


def test_the_slot_renders_the_attached_routers_metrics() -> None:
    slot = MetricsSlot()
    assert slot.exposition() is None  # no request has made the router yet
    cluster = Cluster(RouterConfig(replicas=("ray://r1",)))
    cluster.set_health("ray://r1", ready=True)
    metrics = slot.attach(cluster)
    routed = cluster.route(list(range(40)))
    cluster.dispatch("ray://r1", routed)
    metrics.count("ray://r1", routed)
    text = (slot.exposition() or b"").decode()
    assert 'inferd_router_requests_total{outcome="cold",replica="ray://r1"} 1.0' in text
    assert 'inferd_router_prompt_tokens_total{replica="ray://r1"} 40.0' in text
    assert 'inferd_router_in_flight{replica="ray://r1"} 1.0' in text
