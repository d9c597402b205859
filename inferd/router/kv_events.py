"""The router's KV-event subscriptions: each followed replica's block events feed its exact index.

One asyncio task per replica given a KV-events endpoint (`--replica-kv-events URL=ENDPOINT`, or
every replica of `inferd serve --data-parallel-size N --kv-events-endpoint ...`) reads the
batches the replica publishes (inferd/kv_cache/events.py) and applies them to the cluster's
`PrefixIndex` with `apply_batch`, the pure part: BlockStored adds hashes, BlockRemoved removes
them, and a gap (batches missed, the subscriber just joined, or the replica restarted and counts
from 0 again) first drops what was known of that replica. A subscription that fails is restarted
after `retry_s`, its replica's set dropped: its first batch is a gap anyway. The tasks only feed
the index; the policy reads it as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

from inferd.kv_cache.events import BlockStored, ReceivedBatch, kv_event_batches
from inferd.router.index import PrefixIndex
from inferd.router.metrics import RouterMetrics

logger = logging.getLogger("inferd.router")

# endpoint -> the batches published there (kv_event_batches; a fake in tests).
BatchSource = Callable[[str], AsyncIterator[ReceivedBatch]]


@dataclass(frozen=True)
class Applied:
    """What one batch did to a replica's index (for the router's metrics)."""

    stored: int  # BlockStored events
    removed: int  # BlockRemoved events
    gap: bool  # the replica's set was dropped first


def apply_batch(index: PrefixIndex, replica: str, received: ReceivedBatch) -> Applied:
    """Applies one received batch to `replica`'s exact index, in order.

    >>> from inferd.kv_cache.events import BlockRemoved, KVEventBatch
    >>> index = PrefixIndex(8); index.follow_events("a")
    >>> batch = KVEventBatch(5, 0.0, [BlockStored([1, 2], None, [], 1), BlockRemoved([2])])
    >>> apply_batch(index, "a", ReceivedBatch(batch, gap=True)), index.match("a", [1, 2])
    (Applied(stored=1, removed=1, gap=True), 1)
    """
    if received.gap:
        index.reset(replica)
    stored = removed = 0
    for event in received.batch.events:
        if isinstance(event, BlockStored):
            index.stored(replica, event.block_hashes)
            stored += 1
        else:
            index.removed(replica, event.block_hashes)
            removed += 1
    return Applied(stored, removed, received.gap)


def subscribe_address(endpoint: str) -> str:
    """Where a subscriber on this machine connects to a publisher bound to `endpoint`.

    >>> subscribe_address("tcp://*:5557"), subscribe_address("tcp://0.0.0.0:5557")
    ('tcp://127.0.0.1:5557', 'tcp://127.0.0.1:5557')
    """
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if endpoint.startswith(wildcard):
            return "tcp://127.0.0.1:" + endpoint[len(wildcard) :]
    return endpoint


class KVEventFeed:
    """The subscription tasks: `start` in the router's lifespan, `stop` at shutdown."""

    def __init__(
        self,
        index: PrefixIndex,
        endpoints: Mapping[str, str],
        metrics: RouterMetrics,
        source: BatchSource = kv_event_batches,
        retry_s: float = 1.0,
    ) -> None:
        self._index = index
        self._endpoints = dict(endpoints)
        self._metrics = metrics
        self._source = source
        self._retry_s = retry_s
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for replica, endpoint in self._endpoints.items():
            self._index.follow_events(replica)
            self._tasks.append(asyncio.create_task(self._follow(replica, endpoint)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def _follow(self, replica: str, endpoint: str) -> None:
        while True:
            try:
                async for received in self._source(endpoint):
                    self._record(replica, apply_batch(self._index, replica, received))
            except Exception:  # a broken subscription must not end the router: start a new one
                logger.warning("KV events from %s (%s) failed", replica, endpoint, exc_info=True)
            self._index.reset(replica)
            await asyncio.sleep(self._retry_s)

    def _record(self, replica: str, applied: Applied) -> None:
        m = self._metrics
        if applied.gap:
            m.kv_event_gaps.labels(replica).inc()
        if applied.stored:
            m.kv_events.labels(replica, "stored").inc(applied.stored)
        if applied.removed:
            m.kv_events.labels(replica, "removed").inc(applied.removed)
