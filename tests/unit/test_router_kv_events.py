"""The router's exact prefix index from KV events: applying batches, gaps, and the feed task
(a fake batch source stands in for the ZeroMQ subscription)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.kv_cache.events import BlockRemoved, BlockStored, KVEvent, KVEventBatch, ReceivedBatch
from inferd.router.cluster import Cluster
from inferd.router.command import kv_events_pair
from inferd.router.config import RouterConfig
from inferd.router.index import PrefixIndex
from inferd.router.kv_events import Applied, KVEventFeed, apply_batch, subscribe_address
from inferd.router.launch import replica_kv_events
from inferd.router.metrics import RouterMetrics


def batch(events: list[KVEvent], gap: bool = False, seq: int = 0) -> ReceivedBatch:
    return ReceivedBatch(KVEventBatch(seq, 0.0, events), gap)


def stored(*hashes: int) -> BlockStored:
    return BlockStored(list(hashes), None, [], 16)


def test_stored_and_removed_events_are_the_index() -> None:
    index = PrefixIndex(capacity_blocks=2)
    index.follow_events("a")
    applied = apply_batch(index, "a", batch([stored(1, 2, 3), BlockRemoved([3]), stored(4)]))
    assert applied == Applied(stored=2, removed=1, gap=False)
    # No LRU bound for an exact replica: the replica's own cache bounds it.
    assert index.match("a", [1, 2, 3]) == 2 and index.size("a") == 3


def test_routing_decisions_do_not_touch_an_exact_replica() -> None:
    index = PrefixIndex(capacity_blocks=8)
    index.follow_events("a")
    index.insert("a", [1, 2])
    index.insert("b", [1, 2])
    assert index.match("a", [1, 2]) == 0 and index.match("b", [1, 2]) == 2
    assert index.is_exact("a") and not index.is_exact("b")


def test_a_gap_drops_the_replica_before_its_batch_applies() -> None:
    index = PrefixIndex(capacity_blocks=8)
    index.follow_events("a")
    index.follow_events("b")
    apply_batch(index, "a", batch([stored(1, 2)]))
    apply_batch(index, "b", batch([stored(1, 2)]))
    assert apply_batch(index, "a", batch([stored(7)], gap=True)).gap
    assert index.match("a", [1]) == 0 and index.match("a", [7]) == 1
    assert index.match("b", [1, 2]) == 2  # the other replica is untouched


def test_an_ejection_keeps_an_exact_replica_and_forgets_an_approximate_one() -> None:
    cluster = Cluster(
        RouterConfig(replicas=("http://a", "http://b/"), kv_events=(("http://b/", "tcp://b:1"),))
    )
    for url in cluster.names():
        cluster.index.insert(url, [1])
        cluster.index.stored(url, [1])
        cluster.set_health(url, ready=True)
        cluster.failed(url, "connect_error")
    assert cluster.index.size("http://a") == 0 and cluster.index.size("http://b") == 1


op = st.one_of(
    st.tuples(st.just("stored"), st.lists(st.integers(0, 20), max_size=4)),
    st.tuples(st.just("removed"), st.lists(st.integers(0, 20), max_size=4)),
    st.tuples(st.just("gap"), st.lists(st.integers(0, 20), max_size=4)),
)


@settings(deadline=None)  # a loaded 2-core box must not fail a pure test
@given(st.lists(op, max_size=40))
def test_the_index_is_the_set_implied_since_the_last_gap(ops: list[tuple[str, list[int]]]) -> None:
    index = PrefixIndex(capacity_blocks=1)
    index.follow_events("a")
    expected: set[int] = set()
    for kind, hashes in ops:
        if kind == "removed":
            apply_batch(index, "a", batch([BlockRemoved(hashes)]))
            expected -= set(hashes)
        else:
            if kind == "gap":
                expected = set()
            apply_batch(index, "a", batch([stored(*hashes)], gap=kind == "gap"))
            expected |= set(hashes)
        index.insert("a", [99])  # routing decisions never add to an exact replica
    assert {h for h in range(21) if index.match("a", [h]) == 1} == expected
    assert index.size("a") == len(expected)


class _Source:
    """Per endpoint: the batches it yields, then a failure (the feed must resubscribe)."""

    def __init__(self, batches: list[ReceivedBatch]) -> None:
        self.batches = batches
        self.subscriptions = 0
        self.done = asyncio.Event()

    async def __call__(self, endpoint: str) -> AsyncIterator[ReceivedBatch]:
        self.subscriptions += 1
        if self.subscriptions > 1:
            self.done.set()
            await asyncio.Event().wait()  # the second subscription stays open, silent
        for received in self.batches:
            yield received
        raise ConnectionError("publisher went away")


def test_the_feed_applies_batches_counts_them_and_resubscribes_after_a_failure() -> None:
    config = RouterConfig(replicas=("http://a",), kv_events=(("http://a", "tcp://127.0.0.1:1"),))
    cluster = Cluster(config)
    metrics = RouterMetrics(cluster)
    source = _Source([batch([stored(1, 2)], gap=True, seq=3), batch([BlockRemoved([2])], seq=4)])
    seen: list[int] = []

    async def run() -> None:
        feed = KVEventFeed(cluster.index, config.kv_event_endpoints(), metrics, source, 0.0)
        feed.start()
        await asyncio.wait_for(source.done.wait(), 5)
        seen.append(cluster.index.size("http://a"))
        await feed.stop()

    asyncio.run(run())
    # The failed subscription dropped what it had built: the next one starts with a gap.
    assert seen == [0] and source.subscriptions == 2
    value = metrics.registry.get_sample_value
    assert value("inferd_router_kv_events_total", {"replica": "http://a", "kind": "stored"}) == 1
    assert value("inferd_router_kv_events_total", {"replica": "http://a", "kind": "removed"}) == 1
    assert value("inferd_router_kv_event_gaps_total", {"replica": "http://a"}) == 1


def test_flags_and_config() -> None:
    assert kv_events_pair("http://h:8000=tcp://h:5557") == ("http://h:8000", "tcp://h:5557")
    with pytest.raises(ValueError, match="URL=ENDPOINT"):
        kv_events_pair("tcp://h:5557")
    with pytest.raises(ValueError, match="no --replica"):
        RouterConfig(replicas=("http://a",), kv_events=(("http://b", "tcp://b:1"),))
    with pytest.raises(ValueError, match="tcp://"):
        RouterConfig(replicas=("http://a",), kv_events=(("http://a", "b:1"),))
    assert subscribe_address("tcp://10.0.0.1:9") == "tcp://10.0.0.1:9"
    assert replica_kv_events(["http://a"], None) == ()
    assert replica_kv_events(["http://a", "http://b"], "tcp://0.0.0.0:7")[1] == (
        "http://b",
        "tcp://127.0.0.1:8",
    )
