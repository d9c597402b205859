"""KV events: which cached blocks a replica stored and removed, by stable block hash, over ZeroMQ.

A router that wants to know exactly what each replica's prefix cache holds subscribes to it
(`inferd serve --kv-events-endpoint tcp://*:5557`) instead of estimating from its own routing:

    replica: PrefixCache --stored/removed--> KVEventLog --per step--> KVEventPublisher (PUB, bind)
    router:  KVEventSubscriber (SUB, connect) --ReceivedBatch--> its per-replica block-hash index

Hashes are `inferd.kv_cache.block_hash` chained hashes, the ones the router computes from token
ids itself, so "the replica holds this prompt's first k blocks" is "it holds its first k hashes".
`BlockStored` is published once a block's K/V are computed and findable by a prefix lookup;
`BlockRemoved` when the replica's last cached block with that hash is evicted. Each hash is
stored at most once until it is removed, so a set of hashes per replica is the whole index. A
block whose parent was removed can no longer be found in the replica either, so counting the
leading hashes a replica holds stays exact up to one case: a child cached under an evicted parent
keeps its hash alive until it is evicted itself (LRU), after its prefix was recomputed.

Delivery. One `KVEventBatch` per engine step that changed the cache, numbered from 0 by `seq`.
PUB drops what a slow or absent subscriber cannot take, so a subscriber checks `seq`: a batch that
is not the next one (the first it sees is not seq 0, a batch was dropped, or the replica
restarted and counts from 0 again) arrives with `gap=True`, and the subscriber must then treat
its view of that replica as incomplete (drop it and rebuild from the events that follow, falling
back to an estimate meanwhile). There is no replay.

Wire format: two frames, the topic (b"kv" by default) and the msgpack-encoded KVEventBatch.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

DEFAULT_TOPIC = b"kv"
# Batches a PUB socket queues per subscriber before it drops (then the subscriber sees a gap).
_SEND_HWM = 100_000


class BlockStored(msgspec.Struct, tag="stored"):
    """Consecutive full blocks of one sequence became findable, in sequence order."""

    block_hashes: list[int]
    # The hash of the block before block_hashes[0]; None when it is the sequence's first block.
    parent_block_hash: int | None
    # The blocks' token ids, block_size per hash (a subscriber can check the hashes with them).
    token_ids: list[int]
    block_size: int


class BlockRemoved(msgspec.Struct, tag="removed"):
    """Blocks evicted from the prefix cache: no longer findable."""

    block_hashes: list[int]


KVEvent = BlockStored | BlockRemoved


class KVEventBatch(msgspec.Struct, frozen=True):
    """What one engine step changed in the cache, in order."""

    seq: int  # 0, 1, 2, ... per publisher (a restarted replica starts again at 0)
    ts: float  # time.time() when published
    events: list[KVEvent]


class KVEventLog:
    """Collects the prefix cache's changes between two drains (the engine drains it each step).

    Adjacent changes of the same kind are merged: a sequence's blocks registered one after the
    other become one BlockStored, evictions in a row one BlockRemoved.

    >>> log = KVEventLog(block_size=2)
    >>> log.stored(11, None, (1, 2)); log.stored(12, 11, (3, 4)); log.removed(9)
    >>> [type(e).__name__ for e in log.drain()], log.drain()
    (['BlockStored', 'BlockRemoved'], [])
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVEvent] = []

    def stored(self, block_hash: int, parent_hash: int | None, tokens: Sequence[int]) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockStored) and last.block_hashes[-1] == parent_hash:
            last.block_hashes.append(block_hash)
            last.token_ids.extend(tokens)
            return
        self._events.append(BlockStored([block_hash], parent_hash, list(tokens), self.block_size))

    def removed(self, block_hash: int) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
            return
        self._events.append(BlockRemoved([block_hash]))

    def drain(self) -> list[KVEvent]:
        """The changes since the last drain, oldest first; the log is empty afterwards."""
        events, self._events = self._events, []
        return events


class KVEventPublisher:
    """Binds a PUB socket at `endpoint` (e.g. tcp://*:5557) and sends numbered batches."""

    def __init__(self, endpoint: str, topic: bytes = DEFAULT_TOPIC) -> None:
        self.topic = topic
        self._ctx = zmq.Context()
        self._socket: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, _SEND_HWM)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0

    def publish(self, events: list[KVEvent]) -> None:
        """Sends one batch; nothing when `events` is empty (no seq is used up). Never blocks."""
        if not events:
            return
        batch = KVEventBatch(seq=self._seq, ts=time.time(), events=events)
        self._seq += 1
        self._socket.send_multipart([self.topic, self._encoder.encode(batch)])

    def close(self) -> None:
        self._socket.close(linger=0)
        self._ctx.term()


@dataclass(frozen=True)
class ReceivedBatch:
    batch: KVEventBatch
    # Batches were missed before this one (or the replica restarted): what the subscriber knew
    # of the replica is incomplete; drop it before applying `batch`.
    gap: bool


class KVEventSequence:
    """Decodes batches and notices gaps in their numbering; no socket (any transport can feed it).

    >>> seq = KVEventSequence()
    >>> enc = msgspec.msgpack.Encoder().encode
    >>> [seq.decode(enc(KVEventBatch(s, 0.0, []))).gap for s in (0, 1, 3, 4, 0)]
    [False, False, True, False, True]
    """

    def __init__(self) -> None:
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._next_seq = 0

    def decode(self, payload: bytes | memoryview) -> ReceivedBatch:
        batch = self._decoder.decode(payload)
        gap = batch.seq != self._next_seq
        self._next_seq = batch.seq + 1
        return ReceivedBatch(batch, gap)


class KVEventSubscriber:
    """Connects a SUB socket to one replica's `--kv-events-endpoint` (blocking receive)."""

    def __init__(self, endpoint: str, topic: bytes = DEFAULT_TOPIC) -> None:
        self._ctx = zmq.Context()
        self._socket: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic)
        self._socket.connect(endpoint)
        self._sequence = KVEventSequence()

    def receive(self, timeout_s: float | None = None) -> ReceivedBatch | None:
        """The next batch; None when none came within `timeout_s` (None: wait for ever)."""
        timeout_ms = None if timeout_s is None else int(timeout_s * 1000)
        if not self._socket.poll(timeout_ms):
            return None
        _topic, payload = self._socket.recv_multipart()
        return self._sequence.decode(payload)

    def close(self) -> None:
        self._socket.close(linger=0)
        self._ctx.term()


async def kv_event_batches(
    endpoint: str, topic: bytes = DEFAULT_TOPIC
) -> AsyncGenerator[ReceivedBatch, None]:
    """The batches one replica publishes, for an asyncio router; closes its socket when the
    iteration ends (break or cancellation)."""
    ctx = zmq.asyncio.Context()
    socket = ctx.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SUBSCRIBE, topic)
    socket.connect(endpoint)
    sequence = KVEventSequence()
    try:
        while True:
            _topic, payload = await socket.recv_multipart()
            yield sequence.decode(payload)
    finally:
        socket.close(linger=0)
        ctx.term()
