"""BlockManager and PrefixCache: allocation, reference counts, prefix hits and LRU eviction."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.kv_cache.block_manager import OUT_OF_WINDOW, BlockManager
from inferd.kv_cache.prefix_cache import ROOT_SERIAL

BS = 4


def computed(bm: BlockManager, rid: str, tokens: list[int]) -> None:
    """Allocates for `tokens` and marks them all computed, as one step of the scheduler would."""
    assert bm.allocate(rid, len(tokens))
    bm.cache_full_blocks(rid, tokens, len(tokens))


def test_allocate_grow_and_free() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    assert (bm.num_blocks, bm.block_size, bm.num_free_blocks, bm.usage) == (8, BS, 8, 0.0)
    assert bm.allocate("a", 5)
    assert len(bm.block_table("a")) == 2
    assert bm.allocate("a", 8)  # still two blocks
    assert len(bm.block_table("a")) == 2
    assert bm.allocate("a", 9)
    table = bm.block_table("a")
    assert len(table) == 3 and len(set(table)) == 3
    assert bm.num_free_blocks == 5 and bm.usage == pytest.approx(3 / 8)
    assert all(bm.ref_count(b) == 1 for b in table)
    bm.free("a")
    assert bm.num_free_blocks == 8 and bm.block_table("a") == []
    bm.free("a")  # freeing twice by id is a no-op, never a double free of blocks
    bm.free("never-seen")
    bm.check_invariants()


def test_allocate_is_all_or_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    assert bm.allocate("a", 8)
    assert not bm.allocate("b", 8)
    assert bm.block_table("b") == [] and bm.num_free_blocks == 1
    assert not bm.allocate("a", 13)  # needs two more, one is free
    assert len(bm.block_table("a")) == 2 and bm.num_free_blocks == 1
    bm.check_invariants()


def test_invalid_pool() -> None:
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=BS)


def test_prefix_hit_shares_blocks_and_counts_references() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(10))
    computed(bm, "a", prompt)  # blocks 0, 1 full; block 2 partial (never cached)
    assert bm.num_cached_blocks == 2
    hit = bm.lookup_prefix([*prompt[:8], 99, 98])
    assert hit.num_tokens == 8 and list(hit.block_ids) == bm.block_table("a")[:2]
    assert bm.allocate("b", 10, hit)
    table_b = bm.block_table("b")
    assert table_b[:2] == bm.block_table("a")[:2] and table_b[2] != bm.block_table("a")[2]
    assert [bm.ref_count(b) for b in table_b] == [2, 2, 1]
    bm.free("a")
    assert [bm.ref_count(b) for b in table_b] == [1, 1, 1]
    bm.free("b")
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 2
    bm.check_invariants()


def test_hit_never_covers_the_last_token() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    computed(bm, "a", list(range(12)))
    assert bm.lookup_prefix(list(range(12))).num_tokens == 8
    assert bm.lookup_prefix(list(range(9))).num_tokens == 8
    assert bm.lookup_prefix(list(range(8))).num_tokens == 4
    assert bm.lookup_prefix([0]).num_tokens == 0
    assert bm.lookup_prefix([]).num_tokens == 0


def test_only_computed_full_blocks_are_cached() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    tokens = list(range(12))
    assert bm.allocate("a", 12)
    bm.cache_full_blocks("a", tokens, 6)  # chunked prefill: 6 of 12 computed
    assert bm.num_cached_blocks == 1
    assert bm.lookup_prefix([*tokens, 1]).num_tokens == 4
    bm.cache_full_blocks("a", tokens, 12)
    assert bm.lookup_prefix([*tokens, 1]).num_tokens == 12


def test_disabled_prefix_caching() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    computed(bm, "a", list(range(8)))
    assert bm.num_cached_blocks == 0
    assert bm.lookup_prefix(list(range(9))).num_tokens == 0
    bm.free("a")
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_hash_collision_does_not_hit() -> None:
    # CPython hashes -1 and -2 alike, so these two blocks' keys collide; equality must decide.
    a, b = [-1] * BS, [-2] * BS
    assert hash((ROOT_SERIAL, tuple(a))) == hash((ROOT_SERIAL, tuple(b)))
    bm = BlockManager(num_blocks=8, block_size=BS)
    computed(bm, "a", a)
    assert bm.lookup_prefix([*a, 0]).num_tokens == BS
    assert bm.lookup_prefix([*b, 0]).num_tokens == 0


def test_same_block_tokens_under_another_prefix_do_not_hit() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    computed(bm, "a", [1, 1, 1, 1, 5, 5, 5, 5])
    assert bm.lookup_prefix([2, 2, 2, 2, 5, 5, 5, 5, 0]).num_tokens == 0
    assert bm.lookup_prefix([1, 1, 1, 1, 5, 5, 5, 5, 0]).num_tokens == 8


def test_eviction_takes_uncached_first_then_least_recently_freed_tail_first() -> None:
    bm = BlockManager(num_blocks=7, block_size=BS)
    a, b = list(range(12)), list(range(100, 112))
    computed(bm, "a", a)
    computed(bm, "b", b)
    assert bm.allocate("c", 1)  # the one never-cached block
    table_a, table_b = bm.block_table("a"), bm.block_table("b")
    bm.free("a")  # freed first: evicted first, its tail before its prefix
    bm.free("b")
    bm.free("c")
    assert bm.num_free_blocks == 7 and bm.num_cached_blocks == 6
    assert bm.allocate("d", 1)
    assert bm.num_cached_blocks == 6  # the uncached block went first
    assert bm.allocate("d", 5)
    assert bm.block_table("d")[1] == table_a[2]
    assert bm.lookup_prefix([*a, 0]).num_tokens == 8
    assert bm.allocate("d", 13)
    assert bm.block_table("d")[2:] == [table_a[1], table_a[0]]
    assert bm.lookup_prefix([*a, 0]).num_tokens == 0
    assert bm.lookup_prefix([*b, 0]).block_ids == tuple(table_b)
    bm.check_invariants()


def test_a_hit_revives_an_evictable_block_and_protects_it() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    computed(bm, "a", list(range(8)))
    bm.free("a")
    hit = bm.lookup_prefix(list(range(5)))
    assert hit.num_tokens == 4
    assert bm.allocate("b", 9, hit)  # the hit block plus two new: evicts only a's tail block
    assert bm.block_table("b")[0] == hit.block_ids[0] and bm.ref_count(hit.block_ids[0]) == 1
    assert bm.num_free_blocks == 0
    bm.check_invariants()
    assert not bm.allocate("c", 1)


def test_revived_blocks_count_against_free_space() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    computed(bm, "a", list(range(8)))
    bm.free("a")
    hit = bm.lookup_prefix(list(range(9)))
    assert hit.num_tokens == 8
    assert not bm.allocate("b", 9, hit)  # two revived + one new > two free
    assert bm.block_table("b") == [] and bm.num_free_blocks == 2
    bm.check_invariants()


def test_duplicate_content_is_cached_once_and_nothing_leaks() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    tokens = list(range(9))
    for rid in ("a", "b"):  # both computed the same prefix in one step
        assert bm.allocate(rid, 9)
    for rid in ("a", "b"):
        bm.cache_full_blocks(rid, tokens, 9)
    assert bm.num_cached_blocks == 2
    assert bm.lookup_prefix(tokens).block_ids == tuple(bm.block_table("a")[:2])
    bm.free("b")
    bm.free("a")
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2
    bm.check_invariants()


def test_child_of_an_evicted_block_is_unreachable() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    tokens = list(range(9))
    computed(bm, "a", tokens[:4])  # head h
    computed(bm, "b", tokens[:8])  # b's head duplicates h; b's second block chains onto h
    assert bm.lookup_prefix(tokens).num_tokens == 8
    bm.free("a")
    assert bm.allocate("c", 1)  # evicts h, while b still holds the child
    assert bm.lookup_prefix(tokens).num_tokens == 0
    bm.free("c")
    computed(bm, "d", tokens[:4])  # same head tokens again: a new serial, not h's
    assert bm.lookup_prefix(tokens).num_tokens == 4
    bm.check_invariants()


@settings(max_examples=150, deadline=None)
@given(
    num_blocks=st.integers(1, 12),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["alloc", "free", "compute"]),
            st.integers(0, 3),  # request
            st.integers(1, 20),  # tokens
            st.integers(0, 2),  # prompt family: shared prefixes
            st.sampled_from([None, "x", "y"]),  # LoRA adapter (None: the base model)
        ),
        max_size=40,
    ),
    prefix=st.booleans(),
)
def test_random_operations_keep_the_pool_consistent(
    num_blocks: int, ops: list[tuple[str, int, int, int, str | None]], prefix: bool
) -> None:
    bs = 2
    bm = BlockManager(num_blocks=num_blocks, block_size=bs, enable_prefix_caching=prefix)
    tokens: dict[str, list[int]] = {}
    done: dict[str, int] = {}
    lora_of: dict[str, str | None] = {}
    # What each computed block's K/V encode: (adapter, every token up to its end). A hit must
    # hand out only blocks whose K/V are the requester's own, adapter included.
    kv: dict[int, tuple[str | None, tuple[int, ...]]] = {}
    for op, r, n, family, lora in ops:
        rid = f"r{r}"
        if op == "free":
            bm.free(rid)
            tokens.pop(rid, None)
            done.pop(rid, None)
        elif op == "alloc" and rid not in tokens:
            seq = [family * 100 + i for i in range(n)]
            hit = bm.lookup_prefix(seq, lora)
            assert hit.num_tokens < n
            for i, block in enumerate(hit.block_ids):
                assert kv[block] == (lora, tuple(seq[: (i + 1) * bs]))
            if bm.allocate(rid, n, hit, lora):
                tokens[rid], done[rid], lora_of[rid] = seq, hit.num_tokens, lora
        elif op == "compute" and rid in tokens:
            seq = tokens[rid]
            done[rid] = len(seq)
            table = bm.block_table(rid)
            for i in range(len(seq) // bs):
                kv[table[i]] = (lora_of[rid], tuple(seq[: (i + 1) * bs]))
            bm.cache_full_blocks(rid, seq, done[rid])
        bm.check_invariants()
    for rid in list(tokens):
        bm.free(rid)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def test_window_releases_blocks_before_it_and_a_hit_takes_only_the_window() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, window=3)
    tokens = list(range(10, 20))
    assert bm.allocate("a", 10)
    bm.cache_full_blocks("a", tokens, 8)
    bm.release_out_of_window("a", 8)  # the next query (8) sees 6..8: blocks 0-2 go back
    assert bm.block_table("a")[:4] == [OUT_OF_WINDOW] * 3 + [3]
    assert bm.num_free_blocks == 8 - 2 and bm.num_cached_blocks == 4  # released, still findable
    bm.check_invariants()
    hit = bm.lookup_prefix(tokens[:9])
    assert hit.num_tokens == 8
    assert bm.allocate("b", 9, hit)  # its query 8 sees 6..8: only hit block 3 is taken
    assert bm.block_table("b")[:4] == [OUT_OF_WINDOW] * 3 + [3] and bm.ref_count(3) == 2
    bm.check_invariants()
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_window_bounds_the_blocks_a_request_holds() -> None:
    bm = BlockManager(num_blocks=4, block_size=4, window=7)
    # A 16-token chunk after 7 positions of window: (16 + 7 - 2) // 4 + 2 = 7 blocks at most.
    assert bm.max_blocks_held(1000, 16) == 7 and bm.max_blocks_held(10, 16) == 3
    assert BlockManager(4, 4).max_blocks_held(1000, 16) == 250
