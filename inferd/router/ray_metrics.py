"""The Ray Serve path's router metrics: the request router's `RouterMetrics`, served by the
ingress at `GET /router/metrics` (its `/metrics` goes to an engine replica, as every path does).

The request router runs in the ingress's process (route_notes.py says why), so one process-wide
slot joins them: the router `attach`es its cluster when Serve initializes it, then counts its
decisions; the ingress renders whatever is attached. Both sides import this module inside their
functions, because Serve ships their classes by value with copies of module-level names. Nothing
here imports ray, so it is tested on its own.

    metrics = SLOT.attach(cluster)          # CacheAwareRequestRouter.initialize_state
    metrics.count(replica, routed)          # each request it dispatches
    SLOT.exposition()                       # the ingress: Prometheus text, or None
"""

from __future__ import annotations

import contextlib
import threading

from prometheus_client import generate_latest

from inferd.router.cluster import Cluster
from inferd.router.metrics import RouterMetrics


class MetricsSlot:
    """The metrics of the request router in this process (the last one attached: an ingress
    holds one handle to the engine deployment, so one router)."""

    def __init__(self) -> None:
        self._metrics: RouterMetrics | None = None
        self._lock = threading.Lock()  # the router may run on its own thread's event loop

    def attach(self, cluster: Cluster) -> RouterMetrics:
        metrics = RouterMetrics(cluster)
        with self._lock:
            self._metrics = metrics
        return metrics

    def exposition(self) -> bytes | None:
        """The attached router's metrics in Prometheus text format; None before any request
        created the router (Serve makes it with the first call through the handle)."""
        with self._lock:
            metrics = self._metrics
        if metrics is None:
            return None
        # The router may change its replica set while this reads it: read again then.
        for _ in range(2):
            with contextlib.suppress(RuntimeError):
                return generate_latest(metrics.registry)
        return generate_latest(metrics.registry)


SLOT = MetricsSlot()
