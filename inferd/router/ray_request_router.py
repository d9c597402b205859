"""The Ray Serve path's request router: Serve's replica choice made by inferd's `Cluster`, the
same prefix index, token-load accounting and policy as `inferd router` (router/ray_serve.py puts
it on the engine deployment by import path).

What it reads from Serve: the candidate replicas (Serve's replica set is the membership), each
replica's routing stats (`EngineReplica.record_routing_stats`: load gauges, KV capacity and the
block digest, polled every `routing_stats_period_s`), the request's prompt token ids (carried in
the ForwardedRequest the ingress hands over), and each request's end (`decrement_queue_len_cache`;
Serve shows no first byte). Stats reach the router a while after the replica took them, so a
digest resets the index keeping what was dispatched there after it was taken (`DispatchClock`)
or is still in flight.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import OrderedDict, deque
from collections.abc import Mapping
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from inferd.router.cluster import Cluster, Routed
from inferd.router.config import RouterConfig
from inferd.router.digest_pacer import DigestPacer
from inferd.router.load import ReplicaReport, Ticket


def _report(stats: Mapping[str, Any]) -> ReplicaReport:
    return ReplicaReport(
        running=int(stats.get("running", 0)),
        waiting=int(stats.get("waiting", 0)),
        queued=int(stats.get("queued", 0)),
        queued_prompt_tokens=int(stats.get("queued_prompt_tokens", 0)),
        kv_cache_usage=float(stats.get("kv_cache_usage", 0.0)),
        num_blocks=int(stats["num_blocks"]) if "num_blocks" in stats else None,
    )


class DispatchClock:
    """The prefix index's stamp after each dispatch, by wall-clock time: a digest the replica
    took at time t cannot show the blocks of requests dispatched later (stamped higher), so a
    reset keeps those. Bounded; a time before every record answers 0 (keep all the router sent).

    >>> clock = DispatchClock(); clock.record(10.0, 5); clock.record(12.0, 9)
    >>> clock.stamp_at(9.0), clock.stamp_at(11.0), clock.stamp_at(13.0)
    (0, 5, 9)
    """

    def __init__(self, size: int = 4096) -> None:
        self._records: deque[tuple[float, int]] = deque(maxlen=size)

    def record(self, at: float, stamp: int) -> None:
        self._records.append((at, stamp))

    def stamp_at(self, at: float) -> int:
        i = bisect.bisect_right(self._records, at, key=lambda record: record[0])
        return self._records[i - 1][1] if i else 0


def _token_ids(pending: PendingRequest | None) -> tuple[int, ...]:
    # By attribute, not isinstance: the ingress's copy of ForwardedRequest may be a by-value
    # (cloudpickled) class, distinct from this module's.
    for arg in pending.args if pending is not None else ():
        token_ids = getattr(arg, "token_ids", None)
        if isinstance(token_ids, tuple):
            return token_ids
    return ()


class CacheAwareRequestRouter(RequestRouter):
    """Ray Serve's replica choice made by inferd's `Cluster`: replicas are named by their full
    Serve replica id; Serve's replica set is the membership (a replica that dies leaves at once,
    with its prefix index). The returned ranks hold one replica each, so Serve falls back down
    the policy's own ranking when a replica is at `max_ongoing_requests`."""

    # Decisions waiting for on_request_routed, by Serve's internal request id; bounded because
    # a request cancelled while queued in Serve is never routed.
    _MAX_PENDING = 10_000

    def initialize_state(self, **kwargs: Any) -> None:
        """`kwargs`: RouterConfig fields (`policy`, `block_size`, `index_capacity_blocks`,
        `decode_weight`, `balance_abs_threshold`, `balance_rel_threshold`, `seed`)."""
        from inferd.router.ray_metrics import SLOT  # the process's own (see Ingress.forward)

        # RouterConfig insists on a replica; Serve's replica set replaces it below.
        self._cluster = Cluster(RouterConfig(replicas=("ray://pending",), **kwargs))
        self._cluster.set_members(())
        self._metrics = SLOT.attach(self._cluster)
        # With each decision its time (the `route` stage's share spent here).
        self._pending: OrderedDict[str, tuple[Routed, float]] = OrderedDict()
        self._open: dict[str, deque[Ticket]] = {}
        self._clock = DispatchClock()
        # Per replica, when the last digest applied was taken (a stats object is read often).
        self._digest_at: dict[str, float] = {}
        # Applied in choose_replicas, so on the request path: paced as `inferd router` paces
        # its health checks' digests (the replica's `recent_s` stays two stats polls).
        self._pacer = DigestPacer(RouterConfig.health_interval_s)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._cluster.set_members(r.replica_id.to_full_id_str() for r in replicas)
        for name in self._cluster.names():
            self._cluster.set_health(name, ready=True)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._digest_at.pop(replica_id.to_full_id_str(), None)
        self._pacer.forget(replica_id.to_full_id_str())
        if self._cluster.failed(replica_id.to_full_id_str(), "actor_died"):
            self._metrics.ejections.labels(replica_id.to_full_id_str(), "actor_died").inc()
        self._open.pop(replica_id.to_full_id_str(), None)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        t0 = time.perf_counter()
        by_name = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        for name, replica in by_name.items():
            stats = replica.routing_stats or {}
            self._cluster.report(name, _report(stats))
            self._cluster.set_health(name, ready=True)  # Serve offers only live replicas
            self._apply_digest(name, stats)
        skip = [n for n in self._cluster.names() if n not in by_name]
        routed = self._cluster.route(_token_ids(pending_request), exclude=skip)
        if pending_request is not None:
            decided = (routed, time.perf_counter() - t0)
            self._pending[pending_request.metadata.internal_request_id] = decided
            while len(self._pending) > self._MAX_PENDING:
                self._pending.popitem(last=False)
        return [[by_name[name]] for name in routed.decision.ranking]

    def _apply_digest(self, name: str, stats: Mapping[str, Any]) -> None:
        """A digest newer than the last one applied resets the replica's approximate index,
        keeping what was dispatched there after it was taken or is still in flight."""
        taken, hashes = stats.get("digest_at"), stats.get("block_hashes")
        recent = stats.get("num_recent", 0)
        if not isinstance(taken, float) or not isinstance(hashes, list):
            return
        if not isinstance(recent, int) or not 0 <= recent <= len(hashes):
            return  # not one of EngineReplica's digests
        now = time.monotonic()
        if taken <= self._digest_at.get(name, -math.inf) or not self._pacer.due(name, now):
            return
        self._digest_at[name] = taken
        t0 = time.perf_counter()
        since = min(self._cluster.digest_since(name), self._clock.stamp_at(taken))
        self._metrics.digest_applied(name, self._cluster.digest(name, hashes, since, recent))
        cost = time.perf_counter() - t0
        self._pacer.applied(name, now, cost, len(self._cluster.replicas))

    async def _choose_replica_for_request(
        self, pending_request: PendingRequest, *, is_retry: bool = False
    ) -> RunningReplica:
        """Serve's own choice (its FIFO may hand this request the replica another request's
        ranking found), then the dispatch bookkeeping on the replica it really goes to.

        Overrides a private method: Serve (2.60) calls the public `on_request_routed` only with
        strict max_ongoing_requests on, and this is the one place that sees every (request,
        replica) pair."""
        # Imported here, as in Ingress.forward: the process's own notes, whichever copy of
        # this class Serve shipped.
        from inferd.router.route_notes import NOTES, RouteNote

        replica: RunningReplica = await super()._choose_replica_for_request(
            pending_request, is_retry=is_retry
        )
        name = replica.replica_id.to_full_id_str()
        request_id = pending_request.metadata.internal_request_id
        routed, decision_s = self._pending.pop(request_id, (None, 0.0))
        if name in self._cluster.replicas:
            if routed is None:  # routed while another request's decision was pending
                routed = self._cluster.route(_token_ids(pending_request))
            ticket = self._cluster.dispatch(name, routed)
            self._clock.record(time.time(), self._cluster.index.stamp)
            self._open.setdefault(name, deque()).append(ticket)
            self._metrics.count(name, routed)
            self._metrics.decision.observe(decision_s)
            cached = routed.prompt_tokens - ticket.prefill_tokens
            NOTES.put(request_id, RouteNote(decision_s, name, cached))
        return replica

    def decrement_queue_len_cache(self, replica_id: ReplicaID) -> None:
        """Serve calls this when any request on the replica ends: its oldest open ticket ends
        (requests on one replica differ only in prefill tokens, already counted down by then)."""
        super().decrement_queue_len_cache(replica_id)
        if tickets := self._open.get(replica_id.to_full_id_str()):
            tickets.popleft().finish()
