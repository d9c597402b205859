"""Prefix cache: finds full KV blocks already computed for the same token prefix.

Keys. A full block is keyed by `(parent_serial, block_tokens)`: the serial number the cache gave
the block before it in the sequence (ROOT_SERIAL for the first block) and the block's own token
ids. The dict hashes that key, which is vLLM's `hash((parent_hash, tokens))` chain, and then
compares it for equality, so prefixes whose hashes collide never share K/V: the tokens are
compared exactly and the parent serial pins the rest of the prefix. Each registration takes a
fresh serial that is never reused, so a block evicted and refilled with other tokens cannot stand
in for its old content, and the children of an evicted block become unreachable.

Lifetime. A cached block stays findable while a request holds it and, once its reference count is
0, while it waits in the LRU of evictable blocks. The block manager hands out never-cached free
blocks first and evicts from the LRU front (least recently freed) only when none are left.
Requests free their blocks tail first, so a sequence's last blocks are evicted before its prefix,
which later requests are more likely to share.

Stable hashes (`hashing=True`, which KV events need). Each cached block then also carries its
stable chained hash (kv_cache/block_hash.py), computed by the caller from its parent's when it
registers the block; `held_hashes()` lists them for a router's prefix index (the replica's block
digest, gateway `GET /v1/kv_cache/blocks`). With a KVEventLog, events follow hashes, not blocks:
the first indexed block with a hash logs BlockStored, the eviction of the last one BlockRemoved.
(Two blocks can share a hash: a block whose parent was evicted stays indexed, unreachable, until
it is evicted itself, and the same content may meanwhile be computed again under the parent's new
serial.) Without hashing no hash is computed or kept.

Pure Python, single-threaded: the engine loop is the only caller.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from inferd.kv_cache.events import KVEventLog

ROOT_SERIAL = -1

# (serial of the parent block, or for a first block its root: ROOT_SERIAL or an adapter's
# lower one; the block's token ids)
BlockKey = tuple[int, tuple[int, ...]]


@dataclass(frozen=True)
class PrefixHit:
    """Cached blocks covering the first `num_tokens` tokens of a sequence, in order."""

    block_ids: tuple[int, ...] = ()
    # The cache serial of each block: the parents of the sequence's next blocks.
    serials: tuple[int, ...] = ()
    num_tokens: int = 0


NO_HIT = PrefixHit()


@dataclass(frozen=True)
class BlockDigest:
    """The cached blocks' stable hashes, least recently used first, each once; the last
    `num_recent` were in use within the window asked for (held by a running request, or
    released within it): traffic, where the others may be a past workload's leftovers."""

    hashes: list[int]
    num_recent: int = 0


class PrefixCache:
    """Content-addressed index of full, computed blocks plus the LRU of evictable ones."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        events: KVEventLog | None = None,
        hashing: bool = False,
    ) -> None:
        assert events is None or hashing, "KV events are logged by stable hash"
        self.block_size = block_size
        self._events = events
        self.hashing = hashing
        # The stable chained hash of each cached block's content; all None without `hashing`.
        self._hash_of: list[int | None] = [None] * num_blocks
        # Indexed blocks per stable hash (only with `hashing`): stored at 0 -> 1, removed at 1 -> 0.
        self._hash_count: dict[int, int] = {}
        self._index: dict[BlockKey, int] = {}
        self._key_of: list[BlockKey | None] = [None] * num_blocks
        self._serial_of: list[int] = [ROOT_SERIAL] * num_blocks
        self._next_serial = 0
        # Cached blocks with reference count 0, least recently freed first, each with the time
        # it was freed (the caller's clock; non-decreasing along the order). An OrderedDict
        # gives O(1) append, pop-front and removal from the middle (when a prefix hit revives a
        # block).
        self._lru: OrderedDict[int, float] = OrderedDict()

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._index)

    def is_cached(self, block_id: int) -> bool:
        return self._key_of[block_id] is not None

    def lookup(
        self, token_ids: Sequence[int], max_blocks: int, root: int = ROOT_SERIAL
    ) -> PrefixHit:
        """The longest run of cached leading full blocks, at most `max_blocks`, of a sequence
        whose first block chains from `root` (ROOT_SERIAL, or a LoRA adapter's own negative
        root: block_manager.py). No side effect."""
        bs = self.block_size
        block_ids: list[int] = []
        serials: list[int] = []
        parent = root
        for i in range(max_blocks):
            block_id = self._index.get((parent, tuple(token_ids[i * bs : (i + 1) * bs])))
            if block_id is None:
                break
            parent = self._serial_of[block_id]
            block_ids.append(block_id)
            serials.append(parent)
        return PrefixHit(tuple(block_ids), tuple(serials), len(block_ids) * bs)

    def block_hash(self, block_id: int) -> int:
        """The stable hash of a cached block (only with `hashing`)."""
        block_hash = self._hash_of[block_id]
        assert block_hash is not None, f"block {block_id} has no hash"
        return block_hash

    def register(
        self,
        block_id: int,
        parent_serial: int,
        tokens: tuple[int, ...],
        chain: tuple[int, int | None] | None = None,
    ) -> int:
        """Index a full, computed block; returns the serial that now stands for its content.

        `chain` is (the block's stable hash, its parent's or None), given exactly with `hashing`;
        a block that gets indexed is then logged as stored when KV events are collected.

        When equal content is already cached (two requests computed the same prefix in the same
        step), the first block stays the indexed one and `block_id` stays uncached: its owner
        frees it as a plain block. The returned serial is the indexed block's either way, so the
        owner's next blocks chain onto content that is findable.
        """
        assert len(tokens) == self.block_size, "only full blocks are cached"
        assert self._key_of[block_id] is None, f"block {block_id} is already cached"
        assert (chain is None) != self.hashing, "a hash exactly when hashing"
        key = (parent_serial, tokens)
        existing = self._index.get(key)
        if existing is not None:
            return self._serial_of[existing]
        serial = self._next_serial
        self._next_serial += 1
        self._index[key] = block_id
        self._key_of[block_id] = key
        self._serial_of[block_id] = serial
        if chain is not None:
            block_hash, parent_hash = chain
            self._hash_of[block_id] = block_hash
            count = self._hash_count.get(block_hash, 0)
            self._hash_count[block_hash] = count + 1
            if count == 0 and self._events is not None:
                self._events.stored(block_hash, parent_hash, tokens)
        return serial

    def park(self, block_id: int, freed_at: float) -> None:
        """A cached block's last reference went away at `freed_at`: it becomes the most recent
        evictable one."""
        assert self.is_cached(block_id) and block_id not in self._lru
        self._lru[block_id] = freed_at

    def unpark(self, block_id: int) -> None:
        """A prefix hit takes an evictable block back into use."""
        del self._lru[block_id]

    def evict(self) -> int:
        """Drops the least recently freed evictable block from the index and returns its id."""
        block_id, _ = self._lru.popitem(last=False)
        key = self._key_of[block_id]
        assert key is not None
        del self._index[key]
        self._key_of[block_id] = None
        self._serial_of[block_id] = ROOT_SERIAL
        block_hash = self._hash_of[block_id]
        if block_hash is not None:
            self._hash_of[block_id] = None
            count = self._hash_count.pop(block_hash) - 1
            if count:
                self._hash_count[block_hash] = count
            elif self._events is not None:
                self._events.removed(block_hash)
        return block_id

    def held_hashes(self, limit: int, recent_since: float) -> BlockDigest:
        """The stable hashes of the cached blocks, least recently used first, at most the `limit`
        most recent ones (none without `hashing`): what a router's prefix index should hold for
        this replica. Blocks in use by a request count as the most recent (they cannot be
        evicted), the latest indexed first, so a long-lived shared prefix comes last, as a
        router's index touches a prompt tail first; evictable ones follow the LRU, the next to
        go first. Each hash once, at its most recent place. `num_recent`: the in-use ones and
        those freed after `recent_since` (the caller's clock), which the order puts last."""
        if not self.hashing or limit <= 0:
            return BlockDigest([])
        hash_of, lru = self._hash_of, self._lru
        in_use = [b for b in reversed(self._index.values()) if b not in lru]
        recent_lru = 0  # evictable blocks freed within the window: the LRU's newest end
        for freed_at in reversed(lru.values()):
            if freed_at <= recent_since:
                break
            recent_lru += 1
        order = [hash_of[b] for b in lru]
        order += [hash_of[b] for b in in_use]
        if len(self._hash_count) < len(order):
            # A hash twice (see above): each once, at its most recent place. Rare, and slower
            # (~0.1 us a block, in the engine loop), so only then.
            recent = set(order[len(lru) - recent_lru :])
            order = list(dict.fromkeys(reversed(order)))[::-1]
            num_recent = len(recent)
        else:
            num_recent = recent_lru + len(in_use)
        hashes = order[-limit:]
        return BlockDigest(hashes, min(num_recent, len(hashes)))  # type: ignore[arg-type]

    def check_invariants(self, ref_counts: Sequence[int]) -> None:
        """Index and LRU agree with each other and with the reference counts (tests call this)."""
        for key, block_id in self._index.items():
            assert self._key_of[block_id] == key
        assert sum(k is not None for k in self._key_of) == len(self._index)
        for block_id in self._lru:
            assert self.is_cached(block_id) and ref_counts[block_id] == 0
        # With hashing a block has a hash exactly while it is cached; without, none has one.
        for block_id, block_hash in enumerate(self._hash_of):
            assert (block_hash is not None) == (self.hashing and self.is_cached(block_id))
        assert Counter(h for h in self._hash_of if h is not None) == self._hash_count
