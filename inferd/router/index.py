"""Prefix index: which block hashes each replica holds in its KV cache, exact or approximate.

Approximate (the default) is built from the router's own decisions (a request routed to a
replica leaves its prompt's blocks there), not from the replicas: it over-states what a replica
still holds once the replica evicts, so it is bounded per replica with LRU eviction and should be
sized near a replica's KV capacity (too small: false misses; too large: false hits, llm-d's
sizing rule).

Blocks are chained hashes (inferd.kv_cache.block_hash), so a replica holds the first k blocks of a
prompt iff it holds hash k-1 and every hash before it. `insert` touches a prompt's blocks tail
first, so a prefix block is always more recent than the blocks that extend it and LRU evicts
leaves before the prefixes many requests share (as the engine's own prefix cache does).

    index = PrefixIndex(capacity_blocks=4)
    index.insert("a", [1, 2, 3])
    index.match("a", [1, 2, 9])   # 2

Exact, for a replica whose KV events the router follows (`follow_events`, fed by
inferd/router/kv_events.py): the replica's own BlockStored/BlockRemoved events add and remove
hashes (`stored`/`removed`), and the router's decisions no longer `insert` anything there. After
a gap in the events the replica's set is dropped (`reset`) and holds only what was stored since:
a subset of the truth (false misses, never false hits) until the replica re-stores its hot
prefixes (a cache hit publishes nothing; there is no replay). An ejection keeps the set: a
restarted replica numbers its batches from 0 again, which is a gap. Exact sets are bounded by the
replica's own cache, not by LRU here. Between a dispatch and the replica's BlockStored (its
prefill) the blocks are not yet indexed, so a burst sharing a new prefix may spread.

    index.follow_events("b")
    index.stored("b", [1, 2]); index.insert("b", [7]); index.removed("b", [2])
    index.match("b", [1, 2])      # 1
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    """Per-replica LRU sets of block hashes, at most `capacity_blocks` each (or less for a
    replica whose own KV cache is known to be smaller: `set_capacity`)."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}
        # Replicas indexed from their KV events instead of from routing decisions.
        self._exact: set[str] = set()
        self.evictions = 0

    def follow_events(self, replica: str) -> None:
        """The replica's index is exact from now on: emptied, then fed by `stored`/`removed`."""
        self._exact.add(replica)
        self.reset(replica)

    def is_exact(self, replica: str) -> bool:
        return replica in self._exact

    def stored(self, replica: str, hashes: Sequence[int]) -> None:
        """A BlockStored event: the replica now holds `hashes` (no LRU bound here: the
        replica's own cache bounds them)."""
        held = self._blocks.setdefault(replica, OrderedDict())
        for h in hashes:
            held[h] = None

    def removed(self, replica: str, hashes: Sequence[int]) -> None:
        """A BlockRemoved event: the replica evicted `hashes` (unknown ones are ignored: they were
        stored before the last reset)."""
        held = self._blocks.get(replica)
        if held is not None:
            for h in hashes:
                held.pop(h, None)

    def reset(self, replica: str) -> None:
        """Drops what is known of the replica's blocks (a gap in its events), keeping its mode
        and capacity."""
        self._blocks.pop(replica, None)

    def set_capacity(self, replica: str, blocks: int) -> None:
        """The replica holds at most `blocks` KV blocks: its index holds no more (the next
        insert evicts down to it)."""
        self._capacity[replica] = max(1, min(blocks, self.capacity_blocks))

    def capacity(self, replica: str) -> int:
        return self._capacity.get(replica, self.capacity_blocks)

    def match(self, replica: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` the replica holds (does not refresh them)."""
        held = self._blocks.get(replica)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def insert(self, replica: str, hashes: Sequence[int]) -> None:
        """Records that the replica now holds `hashes`, evicting its least recent blocks. A
        no-op for an exact replica: only its events say what it holds."""
        if replica in self._exact:
            return
        held = self._blocks.setdefault(replica, OrderedDict())
        for h in reversed(hashes):
            held[h] = None
            held.move_to_end(h)
        cap = self.capacity(replica)
        while len(held) > cap:
            held.popitem(last=False)
            self.evictions += 1

    def forget(self, replica: str) -> None:
        """The replica restarted or left: nothing it held is known any more. An exact replica
        keeps its set: its events say when it restarted (a gap)."""
        if replica in self._exact:
            return
        self._blocks.pop(replica, None)
        self._capacity.pop(replica, None)

    def size(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))
