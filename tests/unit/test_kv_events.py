"""KV events on CPU: the prefix cache reports blocks stored and removed by their stable chained
hash (equal to `block_hashes` of the token blocks), batches are numbered, and a subscriber's set
of hashes built from the events alone equals what the replica holds."""

from __future__ import annotations

import random

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import make_request, step

from inferd.config import SchedulerConfig
from inferd.kv_cache.block_hash import block_hashes, next_block_hash
from inferd.kv_cache.block_manager import BlockManager
from inferd.kv_cache.events import (
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVEventSequence,
)
from inferd.scheduler.scheduler import Scheduler

BS = 2


def events_bm(num_blocks: int = 4) -> BlockManager:
    return BlockManager(num_blocks, BS, kv_events=True)


def compute(bm: BlockManager, rid: str, tokens: list[int]) -> None:
    """Allocates `tokens` (taking any cached prefix) and registers its full blocks."""
    hit = bm.lookup_prefix(tokens)
    assert bm.allocate(rid, len(tokens), hit)
    bm.cache_full_blocks(rid, tokens, len(tokens))
    bm.check_invariants()


def test_next_block_hash_chains_like_block_hashes() -> None:
    tokens = list(range(100, 140))
    hashes = block_hashes(tokens, 8)
    parent = None
    for i, expected in enumerate(hashes):
        parent = next_block_hash(parent, tokens[i * 8 : (i + 1) * 8])
        assert parent == expected


def test_stored_events_carry_the_chained_hashes_of_the_token_blocks() -> None:
    bm = events_bm()
    a = [1, 2, 3, 4, 5]
    compute(bm, "a", a)
    assert bm.take_kv_events() == [BlockStored(block_hashes(a, BS), None, a[:4], BS)]
    assert bm.take_kv_events() == []
    bm.free("a")
    # Shares a's first block: the hit is taken, only the new second block is stored.
    b = [1, 2, 9, 9, 5]
    compute(bm, "b", b)
    hb = block_hashes(b, BS)
    assert hb[0] == block_hashes(a, BS)[0]
    assert bm.take_kv_events() == [BlockStored([hb[1]], hb[0], [9, 9], BS)]


def test_evictions_are_removed_events_by_hash() -> None:
    bm = events_bm(num_blocks=4)
    a = [1, 2, 3, 4]
    compute(bm, "a", a)
    bm.free("a")
    bm.take_kv_events()
    # Four new blocks: the two never-cached ones first, then a's two cached ones (tail first).
    compute(bm, "c", [50, 51, 52, 53, 54, 55, 56])
    events = bm.take_kv_events()
    ha = block_hashes(a, BS)
    assert events[0] == BlockRemoved([ha[1], ha[0]])
    assert isinstance(events[1], BlockStored)


def test_equal_content_computed_twice_in_one_step_is_stored_once() -> None:
    bm = events_bm(num_blocks=8)
    tokens = [1, 2, 3, 4, 5]
    for rid in ("a", "b"):  # both allocate before either registers: no hit for b
        assert bm.allocate(rid, len(tokens))
    for rid in ("a", "b"):
        bm.cache_full_blocks(rid, tokens, len(tokens))
    bm.check_invariants()
    assert bm.take_kv_events() == [BlockStored(block_hashes(tokens, BS), None, tokens[:4], BS)]


def test_nothing_is_collected_when_kv_events_are_off() -> None:
    bm = BlockManager(4, BS)
    compute(bm, "a", [1, 2, 3, 4, 5])
    assert bm.take_kv_events() == []


def test_batches_are_numbered_and_gaps_and_restarts_show() -> None:
    encode = msgspec.msgpack.Encoder().encode
    stored = BlockStored([2**64 - 1], None, [1, 2], BS)  # hashes use all 64 bits
    seq = KVEventSequence()
    received = [seq.decode(encode(KVEventBatch(s, 1.0, [stored]))) for s in (0, 1, 2)]
    assert [r.gap for r in received] == [False, False, False]
    assert received[0].batch.events == [stored]
    assert seq.decode(encode(KVEventBatch(5, 1.0, []))).gap  # 3 and 4 were dropped
    assert not seq.decode(encode(KVEventBatch(6, 1.0, []))).gap
    assert seq.decode(encode(KVEventBatch(0, 1.0, []))).gap  # the replica restarted
    assert KVEventSequence().decode(encode(KVEventBatch(7, 1.0, []))).gap  # joined late


def apply(index: set[int], events: list[KVEvent]) -> None:
    """What a subscriber does with one batch."""
    for event in events:
        if isinstance(event, BlockStored):
            assert not index & set(event.block_hashes), "a hash is stored twice"
            index.update(event.block_hashes)
        else:
            assert set(event.block_hashes) <= index, "a hash removed that was never stored"
            index.difference_update(event.block_hashes)


def cached_hashes(bm: BlockManager) -> set[int]:
    return {h for h in bm._prefix._hash_of if h is not None}


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32))
def test_a_subscriber_index_matches_the_cache_under_random_shared_prefix_traffic(
    seed: int,
) -> None:
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4)
    s = Scheduler(config, BlockManager(12, 4, kv_events=True), max_model_len=64)
    prefixes = [[rng.randrange(3, 9) for _ in range(rng.randrange(0, 13))] for _ in range(3)]
    index: set[int] = set()
    for i in range(12):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 9) for _ in range(rng.randrange(1, 6))]
        s.add_request(make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 5)))
        for _ in range(rng.randrange(0, 3)):
            step(s)
            apply(index, s.block_manager.take_kv_events())
            assert index == cached_hashes(s.block_manager)
    while s.has_unfinished_requests():
        step(s)
        apply(index, s.block_manager.take_kv_events())
        assert index == cached_hashes(s.block_manager)


def test_the_block_digest_lists_the_cached_hashes_evictable_first_and_shared_prefixes_last() -> (
    None
):
    # What GET /v1/kv_cache/blocks returns (a router resets its index to it): the hashes a
    # router computes from the prompts, least recently used first, each once.
    now = [100.0]
    bm = BlockManager(8, BS, block_hashes=True, clock=lambda: now[0])
    old, shared = [7, 7, 8, 8, 1], [1, 2, 3, 4, 5]
    compute(bm, "old", old)
    bm.free("old")  # evictable, tail first: its leaf goes before its first block
    now[0] = 110.0
    compute(bm, "a", shared)
    h_old, h_shared = block_hashes(old, BS), block_hashes(shared, BS)
    digest = bm.held_hashes(100)
    assert digest.hashes == [h_old[1], h_old[0], h_shared[1], h_shared[0]]
    assert digest.num_recent == 2  # "a" holds its two blocks
    assert bm.held_hashes(100, recent_s=10.5).num_recent == 4  # "old" freed 10 s ago
    assert bm.held_hashes(1).hashes == [h_shared[0]]  # the most recent one
    assert bm.held_hashes(0).hashes == []
    now[0] = 111.0
    bm.free("a")
    assert bm.held_hashes(100).num_recent == 0
    assert bm.held_hashes(100, recent_s=5.0).num_recent == 2
    assert bm.take_kv_events() == []  # hashes without KV events: nothing logged
    bm.check_invariants()
    # Prefix caching off, or hashing off: no digest.
    for off in (BlockManager(8, BS, block_hashes=False), BlockManager(8, BS, False, False, True)):
        compute(off, "a", shared)
        assert off.held_hashes(100).hashes == []


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32))
def test_the_block_digest_is_the_set_kv_events_describe(seed: int) -> None:
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4)
    s = Scheduler(config, BlockManager(12, 4, kv_events=True), max_model_len=64)
    prefixes = [[rng.randrange(3, 9) for _ in range(rng.randrange(0, 13))] for _ in range(3)]
    for i in range(10):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 9) for _ in range(rng.randrange(1, 6))]
        s.add_request(make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 5)))
        for _ in range(rng.randrange(0, 3)):
            step(s)
            bm = s.block_manager
            digest = bm.held_hashes(1000)
            assert len(digest.hashes) == len(set(digest.hashes))
            assert set(digest.hashes) == cached_hashes(bm)
            # The last num_recent are exactly the hashes of blocks running requests hold.
            in_use = {bm._prefix._hash_of[b] for b in bm._prefix._index.values() if bm._ref[b]}
            assert set(digest.hashes[len(digest.hashes) - digest.num_recent :]) == in_use


def test_the_block_digest_lists_a_hash_two_blocks_share_once() -> None:
    # A block whose parent was evicted stays indexed (unreachable) while its owner holds it;
    # the same content computed again under the parent's new serial has the same stable hash.
    bm = BlockManager(num_blocks=4, block_size=4, block_hashes=True)
    tokens = list(range(9))
    for rid, n in (("a", 4), ("b", 8)):
        assert bm.allocate(rid, n)
        bm.cache_full_blocks(rid, tokens[:n], n)
    bm.free("a")
    assert bm.allocate("c", 1)  # evicts the head, while b still holds the block after it
    bm.free("c")
    assert bm.allocate("d", 8)
    bm.cache_full_blocks("d", tokens[:8], 8)
    bm.check_invariants()
    assert bm.num_cached_blocks == 3
    digest = bm.held_hashes(10)
    assert sorted(digest.hashes) == sorted(block_hashes(tokens[:8], 4))
    assert digest.num_recent == 2  # all three blocks are in use: two hashes
