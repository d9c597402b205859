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

Correction from what the replica reports (approximate replicas only). Each block carries a stamp,
a counter that grows with every insert (tail first), so stamps order the LRU. A replica that
answers a request with fewer cached tokens than the index claimed at dispatch has evicted the first
claimed block it did not report, and, evicting least recent first, every block the index had
touched no later than it: `drop_through(replica, stamp)` drops those, so the index stops claiming
blocks the replica no longer holds (false hits: a decision that trusts a cold replica). The
prompt's own blocks are not among them: its dispatch re-stamped them, and the replica has just
computed them again. Dropped blocks are remembered as the replica's ghosts (bounded like its
index): no longer a hit, but where those prefixes lived, so a prompt nobody holds any more goes back
to its former replica when load allows (`home`), instead of scattering its group across replicas.

    index = PrefixIndex(capacity_blocks=10)
    index.insert("a", [5, 6]); index.insert("a", [1, 2, 3])
    claim = index.stamps("a", [1, 2, 3])    # at dispatch, before the insert re-stamps them
    index.insert("a", [1, 2, 3])
    index.drop_through("a", claim[1])       # the replica reported 1 block: 5, 6 are gone
    index.match("a", [1, 2, 3])             # 3 (re-stamped at dispatch)
    index.match("a", [5, 6]), index.home("a", [5, 6])    # 0, 2

Reset from the replica's block digest (approximate replicas, `snapshot`): with each health check
the router reads the hashes the replica's cache holds (gateway GET /v1/kv_cache/blocks, least
recently used first) and the replica's set becomes them, in that order, plus what the router
itself sent there that the digest cannot show yet: blocks stamped after `since`, the stamp at
dispatch of the oldest request still prefilling there when the digest was asked for (their
blocks are registered only after their prefill step). What the index claimed and the digest
lacks becomes ghosts (evicted: the prefix's former home), as with `drop_through`. So an index
that drifted (evictions the router never saw, groups another router placed there) is the
replica's truth again after each check, and routers that share no state converge on it.

A replica's cache is always full of something: blocks of a past workload linger, evictable,
until new ones push them out. They still match, but they are not traffic, so they must not count
in what a replica `owned` (the share of the groups that decides where a new group goes: a
replica full of leftovers would look taken). A block from a digest is *live* when the replica
used it lately (the digest's last `num_recent` hashes: in use, or freed within two check
intervals) or the index already had it live (the router sent a request for it, or an earlier
digest showed it used); the others are *stale* until a request touches them (`insert`). Other
routers' groups with traffic are live, so routers sharing no state also agree on each
replica's share.

    index = PrefixIndex(capacity_blocks=10)
    index.insert("a", [1, 2]); since = index.stamp; index.insert("a", [7])
    index.snapshot("a", [8, 5, 1], since, num_recent=2)   # 2 evicted, 5 used by someone else
    index.match("a", [5]), index.match("a", [1, 2]), index.match("a", [7]), index.home("a", [1, 2])
    # (1, 1, 1, 2)
    index.size("a"), index.owned("a")      # 4 (8, 5, 1, 7), 4 (5, 1, 7 live; 2 a ghost; 8 stale)
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping, Sequence


class PrefixIndex:
    """Per-replica LRU sets of block hashes, at most `capacity_blocks` each (or less for a
    replica whose own KV cache is known to be smaller: `set_capacity`)."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        # Replica -> block hash -> stamp, least recent first (stamps grow along the order).
        self._blocks: dict[str, OrderedDict[int, int]] = {}
        self._capacity: dict[str, int] = {}
        # Blocks the replicas' own reports showed evicted (drop_through), least recent first.
        self._ghosts: dict[str, OrderedDict[int, None]] = {}
        # Blocks a digest showed that no request has touched since (see the module docstring).
        self._stale: dict[str, set[int]] = {}
        # Replicas indexed from their KV events instead of from routing decisions.
        self._exact: set[str] = set()
        self.evictions = 0
        self._stamp = 0

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
            held[h] = self._next_stamp()
            held.move_to_end(h)

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
            held[h] = self._next_stamp()
            held.move_to_end(h)
        if ghosts := self._ghosts.get(replica):
            for h in hashes:
                ghosts.pop(h, None)  # live again
        stale = self._stale.get(replica)
        if stale:
            stale.difference_update(hashes)
        cap = self.capacity(replica)
        while len(held) > cap:
            evicted, _ = held.popitem(last=False)
            if stale:
                stale.discard(evicted)
            self.evictions += 1

    @property
    def stamp(self) -> int:
        """The last stamp given: every block stamped so far has one no larger."""
        return self._stamp

    def _next_stamp(self) -> int:
        self._stamp += 1
        return self._stamp

    def stamps(self, replica: str, hashes: Sequence[int]) -> tuple[int, ...]:
        """The stamps of the leading blocks of `hashes` the replica holds (`match` of them)."""
        held = self._blocks.get(replica)
        if not held:
            return ()
        out: list[int] = []
        for h in hashes:
            stamp = held.get(h)
            if stamp is None:
                break
            out.append(stamp)
        return tuple(out)

    def drop_through(self, replica: str, stamp: int) -> int:
        """The replica evicted the block stamped `stamp`: every block it holds stamped no later
        becomes a ghost (none for an exact replica: its events say what it evicted). Returns how
        many were dropped."""
        held = self._blocks.get(replica)
        if held is None or replica in self._exact:
            return 0
        ghosts = self._ghosts.setdefault(replica, OrderedDict())
        stale = self._stale.get(replica, set())
        dropped = 0
        while held and next(iter(held.values())) <= stamp:
            h = held.popitem(last=False)[0]
            ghosts[h] = None
            stale.discard(h)
            dropped += 1
        # Bounded like the index: older homes than one cache's worth say little any more.
        while len(ghosts) > self.capacity(replica):
            ghosts.popitem(last=False)
        return dropped

    def snapshot(self, replica: str, hashes: Sequence[int], since: int, num_recent: int) -> int:
        """The replica's block digest (`hashes`, least recently used first, the last
        `num_recent` used lately) replaces what the index holds for it, except blocks stamped
        after `since` (dispatched there since, maybe not computed yet when the digest was
        taken), which stay the most recent. Claimed blocks the digest lacks become ghosts;
        blocks neither used lately nor live in the index before become stale. A no-op for an
        exact replica (its events are exact). Returns how many claimed blocks turned out to be
        gone."""
        if replica in self._exact:
            return 0
        # Set and dict operations in C where they can be: a digest is as large as the replica's
        # cache (65k blocks: 26-68 ms on a 2-core VM, in the router's event loop;
        # router/digest_pacer.py spaces large replicas' digests out).
        old = self._blocks.get(replica) or OrderedDict()
        old_stale = self._stale.get(replica, set())
        n = len(hashes)
        first = self._stamp + 1
        self._stamp += n
        held = OrderedDict(zip(hashes, range(first, first + n), strict=True))  # each hash once
        unused = set(hashes[: n - num_recent])
        stale = (unused - old.keys()) | (unused & old_stale)
        # The router's own blocks stamped after `since` (the newest end of `old`) stay newest.
        newer = list(itertools.takewhile(lambda item: item[1] > since, reversed(old.items())))
        for h, _ in reversed(newer):
            held[h] = self._next_stamp()
            held.move_to_end(h)
            if h not in old_stale:
                stale.discard(h)
        cap = self.capacity(replica)
        while len(held) > cap:
            stale.discard(held.popitem(last=False)[0])
        self._blocks[replica] = held
        self._stale[replica] = stale
        return self._bury(replica, old, held)

    def _bury(self, replica: str, old: Mapping[int, int], held: Mapping[int, int]) -> int:
        """Blocks the index held (`old`) and holds no more become the replica's ghosts, in
        their old order; held ones are ghosts no more. Returns how many were buried."""
        ghosts = self._ghosts.setdefault(replica, OrderedDict())
        gone = old.keys() - held.keys()
        if gone:
            for h in old:
                if h in gone:
                    ghosts[h] = None
        for h in ghosts.keys() & held.keys():
            del ghosts[h]
        while len(ghosts) > self.capacity(replica):
            ghosts.popitem(last=False)
        return len(gone)

    def home(self, replica: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` the replica holds or held until its own report
        showed them evicted (`match` counting ghosts too)."""
        held: Mapping[int, int] = self._blocks.get(replica) or {}
        ghosts: Mapping[int, None] = self._ghosts.get(replica) or {}
        n = 0
        for h in hashes:
            if h not in held and h not in ghosts:
                break
            n += 1
        return n

    def owned(self, replica: str) -> int:
        """Live blocks the replica holds, or is the home of (its ghosts): the groups placed
        there, whether or not their blocks are still cached; stale leftovers do not count."""
        live = self.size(replica) - len(self._stale.get(replica, ()))
        return live + len(self._ghosts.get(replica, ()))

    def forget(self, replica: str) -> None:
        """The replica restarted or left: nothing it held is known any more. An exact replica
        keeps its set: its events say when it restarted (a gap)."""
        if replica in self._exact:
            return
        self._blocks.pop(replica, None)
        self._capacity.pop(replica, None)
        self._ghosts.pop(replica, None)
        self._stale.pop(replica, None)

    def size(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))
