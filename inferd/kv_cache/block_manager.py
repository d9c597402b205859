"""Paged KV cache bookkeeping: one pool of fixed-size blocks shared by every request.

Token t of a request lives in block `table[t // block_size]` at offset `t % block_size`. A block
is free when its reference count is 0. Free blocks are of two kinds: never-cached ones on a stack
(handed out first) and cached ones that stay findable by the prefix cache until they are evicted
(least recently freed first, see prefix_cache.py). A cached block is shared between requests with
the same prefix by reference counting; it is never written again, because a request only writes
positions at or after its `num_computed_tokens` and a hit never covers those.

When cached blocks are registered: only after the step that computed them
(`cache_full_blocks`, called from the scheduler's update_from_output), never when they are
allocated. Registering at allocation would let a request in the same step hit a block whose
writer is preempted later in that same schedule() call, so its K/V would never be written.

Stable block hashes (`block_hashes=True`, the engine's setting; off by default here): each cached
block also gets its chained hash (kv_cache/block_hash.py, about 1 us a block), and
`held_hashes()` lists them for a router (the replica's block digest). KV events
(`kv_events=True`, which implies hashes): the prefix cache also logs every block it indexes and
evicts, by that hash (kv_cache/events.py); `take_kv_events()` drains the log once a step. With
neither, no hash is computed and nothing is logged.

LoRA adapters: a request run under an adapter (`lora_name`) has other K/V for the same tokens,
so its blocks chain from the adapter's own root in the prefix cache (a negative serial the
manager gives each adapter name it meets) and its stable hashes from the adapter's seed
(block_hash.py): prompts share cached blocks only under the same adapter.

Sliding windows (`window=W`, given only when every attention layer of the model has a window;
W is the largest). Position p attends to keys p - W + 1 .. p, and a request's next step starts at
its `num_computed_tokens` n, so a block whose positions all lie before n - W + 1 is never read
again: `release_out_of_window` (the scheduler calls it after each step that advanced n) gives it
back to the pool and writes OUT_OF_WINDOW in its place in the table, which keeps its length and
the position -> entry mapping. Those entries are always a leading run of the table, they only
grow while the request runs (n never moves back: drafts' rollback trims the tail, preemption frees
all), and the attention kernels start reading at the first query's window, so they never read one
(the native kernel by its key range, the PyTorch path by gathering from the first kept block; a
CUDA-graph decode row reads block 0 in its place under its window mask). A running sequence then
holds about W / block_size + 1 blocks plus its chunk's, however long it grows
(`max_blocks_held`). Where some layer is global (Gemma 3's pattern) nothing is released: a global
layer reads every position.

With prefix caching, blocks are registered before they are released (`cache_full_blocks` first,
in the same step), and a released cached block is parked in the LRU like any freed cached block:
its content stays findable, and intact, until it is evicted, when it leaves the index before its
memory is reused. A lookup returns only a leading run of indexed blocks, so a hit never names a
block whose K/V are gone. A request taking a hit takes only the hit blocks its own window needs
(from `first_kept_block(hit.num_tokens)`); the ones before become OUT_OF_WINDOW at once and stay
parked. (A hit needs the sequence's leading blocks still indexed; released early, they are also
the first evicted, so long windowed sequences mostly hit while their prompt is recent.)

Pure Python, no torch, single-threaded: the engine loop is the only caller.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

from inferd.kv_cache.block_hash import next_block_hash
from inferd.kv_cache.events import KVEvent, KVEventLog
from inferd.kv_cache.prefix_cache import (
    NO_HIT,
    ROOT_SERIAL,
    BlockDigest,
    PrefixCache,
    PrefixHit,
)

# A block table entry whose block was released: every position in it is outside the window of
# every query the request will still run (see the module docstring). Never a valid block id.
OUT_OF_WINDOW = -1


def first_kept_block(num_computed_tokens: int, window: int | None, block_size: int) -> int:
    """The first table entry a request whose next query is at `num_computed_tokens` still reads:
    the blocks before it lie wholly before that query's window (0 without a window)."""
    if window is None:
        return 0
    return max(0, num_computed_tokens - window + 1) // block_size


class BlockManager:
    """Block pool, reference counts, per-request block tables and the prefix cache.

    >>> bm = BlockManager(num_blocks=4, block_size=2)
    >>> bm.allocate("a", num_tokens=3), bm.block_table("a"), bm.num_free_blocks
    (True, [0, 1], 2)
    >>> bm.cache_full_blocks("a", [7, 8, 9], num_computed_tokens=3)  # block 0 now findable
    >>> bm.lookup_prefix([7, 8, 5]).block_ids
    (0,)
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        kv_events: bool = False,
        block_hashes: bool = False,
        clock: Callable[[], float] = time.monotonic,
        window: int | None = None,
    ) -> None:
        """`window`: the largest sliding window where every attention layer has one (None: some
        layer reads every position, and no block is released before its request ends)."""
        if num_blocks <= 0 or block_size <= 0 or (window is not None and window <= 0):
            raise ValueError("num_blocks, block_size and window must be positive")
        self.window = window
        self._num_blocks = num_blocks
        self._block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        # Never-cached free blocks; reversed so pop() hands out block 0 first.
        self._free = list(range(num_blocks - 1, -1, -1))
        # Only with prefix caching on: without it no block is ever stored, so nothing to tell.
        self._events = KVEventLog(block_size) if kv_events and enable_prefix_caching else None
        hashing = enable_prefix_caching and (kv_events or block_hashes)
        self._prefix = PrefixCache(num_blocks, block_size, self._events, hashing)
        # When blocks are freed (the digest's "used lately"); read once per `free`.
        self._clock = clock
        self._tables: dict[str, list[int]] = {}
        # Per request: the cache serial of each leading full block already registered (or found).
        self._serials: dict[str, list[int]] = {}
        # Per request, with hashing only: the stable hash of each block in `_serials`.
        self._hashes: dict[str, list[int]] = {}
        # The root serial of each adapter met (never reused), and the adapter of each request
        # that runs one.
        self._roots: dict[str, int] = {}
        self._lora_of: dict[str, str] = {}
        # Per request, with a window: how many leading table entries are OUT_OF_WINDOW.
        self._released: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks with reference count 0, evictable cached blocks included."""
        return len(self._free) + self._prefix.num_evictable

    @property
    def num_cached_blocks(self) -> int:
        return self._prefix.num_cached

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self._num_blocks

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids (a copy); empty when it holds none."""
        return list(self._tables.get(request_id, ()))

    def ref_count(self, block_id: int) -> int:
        assert block_id != OUT_OF_WINDOW, "a released entry has no block"
        return self._ref[block_id]

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self._block_size)

    def first_kept_block(self, num_computed_tokens: int) -> int:
        return first_kept_block(num_computed_tokens, self.window, self._block_size)

    def max_blocks_held(self, max_kv_tokens: int, max_chunk_tokens: int) -> int:
        """The most blocks a request with K/V for up to `max_kv_tokens` tokens holds at once when
        a step computes at most `max_chunk_tokens` of them: all of them without a window; with
        one, its window before the chunk's first token plus the chunk, each end in a partial
        block."""
        blocks = self.num_blocks_for(max_kv_tokens)
        if self.window is None:
            return blocks
        return min(blocks, (max_chunk_tokens + self.window - 2) // self._block_size + 2)

    def lookup_prefix(self, token_ids: Sequence[int], lora_name: str | None = None) -> PrefixHit:
        """Cached blocks covering a prefix of `token_ids` as run under adapter `lora_name` (None:
        the base model); nothing is taken yet.

        The hit never covers the last token: at least one token is left to compute, so the model
        produces logits for the last position. Pass the hit to `allocate` to take the blocks.
        """
        if not self.enable_prefix_caching or not token_ids:
            return NO_HIT
        max_blocks = (len(token_ids) - 1) // self._block_size
        return self._prefix.lookup(token_ids, max_blocks, self._root(lora_name))

    def _root(self, lora_name: str | None) -> int:
        """The serial the first block of a sequence under `lora_name` chains from."""
        if lora_name is None:
            return ROOT_SERIAL
        root = self._roots.get(lora_name)
        if root is None:
            root = self._roots[lora_name] = ROOT_SERIAL - 1 - len(self._roots)
        return root

    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        prefix: PrefixHit = NO_HIT,
        lora_name: str | None = None,
    ) -> bool:
        """Grows the request's table to cover its first `num_tokens` tokens.

        `prefix` (only for a request holding no blocks) is taken first, reference count +1 per
        block; `lora_name`, given when the table is created, the adapter the request runs under
        (its blocks are cached under it). All or nothing: on False nothing changed.
        """
        table = self._tables.get(request_id)
        held = len(table) if table is not None else 0
        assert not (prefix.block_ids and held), (
            "a prefix hit is only taken by a request with no blocks"
        )
        num_new = max(0, self.num_blocks_for(num_tokens) - held - len(prefix.block_ids))
        # Hit blocks before the request's window are not taken (module docstring).
        skipped = min(len(prefix.block_ids), self.first_kept_block(prefix.num_tokens))
        taken = prefix.block_ids[skipped:]
        # Hit blocks with reference count 0 come out of the free pool too.
        num_revived = sum(1 for b in taken if self._ref[b] == 0)
        if num_new + num_revived > self.num_free_blocks:
            return False
        if table is None:
            table = self._tables[request_id] = []
            self._serials[request_id] = list(prefix.serials)
            if lora_name is not None:
                self._lora_of[request_id] = lora_name
            if self._prefix.hashing:
                self._hashes[request_id] = [self._prefix.block_hash(b) for b in prefix.block_ids]
            if self.window is not None:
                self._released[request_id] = skipped
                table.extend([OUT_OF_WINDOW] * skipped)
        for block_id in taken:
            self._take_cached(block_id)
            table.append(block_id)
        for _ in range(num_new):
            table.append(self._take_free())
        return True

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Frees the request's blocks past its first `num_tokens` tokens, tail first.

        Speculative decoding's rollback: blocks allocated for draft tokens that were rejected.
        Only blocks never registered (no full computed block lies past the accepted tokens) are
        trimmed, so they go back to the never-cached stack."""
        table = self._tables.get(request_id)
        if table is None:
            return
        keep = self.num_blocks_for(num_tokens)
        while len(table) > keep:
            block_id = table.pop()
            assert block_id != OUT_OF_WINDOW, "trimmed into the released entries"
            assert self._ref[block_id] == 1 and not self._prefix.is_cached(block_id), (
                f"trimmed block {block_id} is shared or cached"
            )
            self._ref[block_id] = 0
            self._free.append(block_id)

    def cache_full_blocks(
        self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int
    ) -> None:
        """Registers the request's full blocks whose tokens are all computed (K/V written)."""
        serials = self._serials.get(request_id)
        if not self.enable_prefix_caching or serials is None:
            return
        table = self._tables[request_id]
        bs = self._block_size
        hashes = self._hashes.get(request_id)
        lora_name = self._lora_of.get(request_id)
        for i in range(len(serials), num_computed_tokens // bs):
            assert table[i] != OUT_OF_WINDOW, "a block is registered before it is released"
            parent = serials[-1] if serials else self._root(lora_name)
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            chain = None
            if hashes is not None:
                parent_hash = hashes[-1] if hashes else None
                chain = (next_block_hash(parent_hash, tokens, lora_name), parent_hash)
                hashes.append(chain[0])
            serials.append(self._prefix.register(table[i], parent, tokens, chain))

    def release_out_of_window(self, request_id: str, num_computed_tokens: int) -> None:
        """Gives back the request's blocks wholly before the window of its next query (at
        `num_computed_tokens`), oldest first; nothing without a window. Call it after
        `cache_full_blocks` for the same step."""
        released = self._released.get(request_id)
        if released is None:
            return
        table = self._tables[request_id]
        first = min(self.first_kept_block(num_computed_tokens), len(table))
        if first <= released:
            return
        now = self._clock()
        for i in range(released, first):
            self._unref(table[i], now)
            table[i] = OUT_OF_WINDOW
        self._released[request_id] = first

    def take_kv_events(self) -> list[KVEvent]:
        """The cache's stored/removed events since the last call; [] when KV events are off."""
        return [] if self._events is None else self._events.drain()

    def held_hashes(self, limit: int, recent_s: float = 0.0) -> BlockDigest:
        """The cached blocks' stable hashes, least recently used first, at most `limit` (the
        most recent), and how many of the last were in use within `recent_s` seconds; none
        without hashing (prefix_cache.py)."""
        return self._prefix.held_hashes(limit, self._clock() - recent_s)

    def free(self, request_id: str) -> None:
        """Releases the request's blocks, tail first (so its prefix is evicted last). Idempotent."""
        table = self._tables.pop(request_id, None)
        self._serials.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self._lora_of.pop(request_id, None)
        released = self._released.pop(request_id, 0)
        now = self._clock() if table else 0.0
        for block_id in reversed((table or [])[released:]):
            self._unref(block_id, now)

    def _unref(self, block_id: int, now: float) -> None:
        """Drops one reference; at 0 the block is free (parked at `now` if cached)."""
        assert self._ref[block_id] > 0, f"double free of block {block_id}"
        self._ref[block_id] -= 1
        if self._ref[block_id] > 0:
            return
        if self._prefix.is_cached(block_id):
            self._prefix.park(block_id, now)
        else:
            self._free.append(block_id)

    def check_invariants(self) -> None:
        """Asserts the pool is consistent: O(num_blocks), for tests and debugging."""
        held = Counter(b for table in self._tables.values() for b in table if b != OUT_OF_WINDOW)
        for request_id, table in self._tables.items():
            # Released entries: exactly a leading run, counted; none without a window.
            released = self._released.get(request_id, 0)
            assert (request_id in self._released) == (self.window is not None)
            assert all(b == OUT_OF_WINDOW for b in table[:released])
            assert OUT_OF_WINDOW not in table[released:]
        assert all(self._ref[b] == held.get(b, 0) for b in range(self._num_blocks))
        free = set(self._free)
        assert len(free) == len(self._free), "a block is twice on the free stack"
        assert not any(self._prefix.is_cached(b) for b in free)
        idle = {b for b in range(self._num_blocks) if self._ref[b] == 0}
        assert idle == free | {b for b in idle if self._prefix.is_cached(b)}
        assert self.num_free_blocks == len(idle)
        if self._prefix.hashing:
            assert all(len(self._hashes[r]) == len(s) for r, s in self._serials.items())
        assert set(self._released) <= set(self._tables)
        self._prefix.check_invariants(self._ref)

    def _take_free(self) -> int:
        block_id = self._free.pop() if self._free else self._prefix.evict()
        assert self._ref[block_id] == 0
        self._ref[block_id] = 1
        return block_id

    def _take_cached(self, block_id: int) -> None:
        if self._ref[block_id] == 0:
            self._prefix.unpark(block_id)
        self._ref[block_id] += 1
