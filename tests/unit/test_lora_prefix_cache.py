"""The prefix cache keyed on the LoRA adapter: the same tokens under two adapters (or an adapter
and the base model) have other K/V, so they share no cached block, and the stable hashes that
leave the replica (KV events, the block digest) are those `block_hashes(..., lora_name=)` gives,
which the router computes on its own."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.kv_cache.block_hash import block_hashes, next_block_hash
from inferd.kv_cache.block_manager import BlockManager
from inferd.kv_cache.events import BlockStored

BS = 4
PROMPT = list(range(100, 113))  # three full blocks and one token more


def compute(bm: BlockManager, rid: str, tokens: list[int], lora: str | None) -> None:
    """Allocates `tokens` under `lora` (taking its cached prefix) and registers its full blocks."""
    hit = bm.lookup_prefix(tokens, lora)
    assert bm.allocate(rid, len(tokens), hit, lora)
    bm.cache_full_blocks(rid, tokens, len(tokens))
    bm.check_invariants()


@pytest.mark.parametrize(("first", "then"), [("x", "y"), ("x", None), (None, "x")])
def test_the_same_prompt_under_another_adapter_or_the_base_hits_nothing(
    first: str | None, then: str | None
) -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    compute(bm, "a", PROMPT, first)
    assert bm.lookup_prefix(PROMPT, first).num_tokens == 12
    assert bm.lookup_prefix(PROMPT, then).num_tokens == 0
    # Computed under `then` too, both stay cached side by side: no block is shared.
    compute(bm, "b", PROMPT, then)
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))
    assert bm.num_cached_blocks == 6
    bm.free("a")
    bm.free("b")
    bm.check_invariants()


def test_the_same_adapter_shares_its_blocks() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    compute(bm, "a", PROMPT, "x")
    hit = bm.lookup_prefix([*PROMPT[:8], 7, 7, 7, 7, 7], "x")
    assert hit.num_tokens == 8 and list(hit.block_ids) == bm.block_table("a")[:2]
    assert bm.allocate("b", 13, hit, "x")
    assert [bm.ref_count(b) for b in hit.block_ids] == [2, 2]
    bm.check_invariants()


def test_an_adapter_keeps_its_root_after_its_requests_leave() -> None:
    # The adapter's blocks stay cached (evictable) once freed; a later request under it hits
    # them, one under another adapter met since does not.
    bm = BlockManager(num_blocks=16, block_size=BS)
    compute(bm, "a", PROMPT, "x")
    bm.free("a")
    compute(bm, "b", [1, 2, 3, 4, 5], "y")
    assert bm.lookup_prefix(PROMPT, "x").num_tokens == 12
    assert bm.lookup_prefix(PROMPT, "y").num_tokens == 0


def test_kv_events_carry_the_adapters_own_chained_hashes() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, kv_events=True)
    compute(bm, "a", PROMPT, "x")
    compute(bm, "b", PROMPT, None)
    hx = block_hashes(PROMPT, BS, lora_name="x")
    hbase = block_hashes(PROMPT, BS)
    assert bm.take_kv_events() == [
        BlockStored(hx, None, PROMPT[:12], BS),
        BlockStored(hbase, None, PROMPT[:12], BS),
    ]
    assert not set(hx) & set(hbase)
    # Extending the adapter's prompt chains from its last block, still under the adapter.
    longer = [*PROMPT, 1, 2, 3]
    compute(bm, "c", longer, "x")
    h4 = next_block_hash(hx[-1], longer[12:16], "x")
    assert h4 == block_hashes(longer, BS, lora_name="x")[3]
    assert bm.take_kv_events() == [BlockStored([h4], hx[-1], longer[12:16], BS)]


def test_the_block_digest_lists_each_adapters_hashes() -> None:
    bm = BlockManager(num_blocks=32, block_size=BS, block_hashes=True)
    for rid, lora in (("a", "x"), ("b", "y"), ("c", None)):
        compute(bm, rid, PROMPT, lora)
    expected = {h for lora in ("x", "y", None) for h in block_hashes(PROMPT, BS, lora_name=lora)}
    digest = bm.held_hashes(100)
    assert len(digest.hashes) == 9 and set(digest.hashes) == expected
    bm.check_invariants()


def test_adapter_seeds_differ_by_name_only() -> None:
    # The hash depends on the adapter's name, not on which process met it first.
    one, two = BlockManager(16, BS, kv_events=True), BlockManager(16, BS, kv_events=True)
    compute(one, "a", PROMPT, "y")
    compute(two, "a", PROMPT, "x")
    compute(two, "b", PROMPT, "y")
    [stored_one] = one.take_kv_events()
    stored_two = two.take_kv_events()[1]
    assert isinstance(stored_one, BlockStored) and isinstance(stored_two, BlockStored)
    assert stored_one.block_hashes == stored_two.block_hashes


@settings(max_examples=100)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 1),  # prompt family: shared prefixes
            st.integers(1, 12),  # tokens
            st.sampled_from([None, "x", "y"]),  # adapter
            st.booleans(),  # freed at once (its blocks stay cached, evictable)
        ),
        max_size=20,
    )
)
def test_every_hit_is_of_blocks_computed_under_the_requests_own_adapter(
    requests: list[tuple[int, int, str | None, bool]],
) -> None:
    bm = BlockManager(num_blocks=10, block_size=2, kv_events=True)
    kv: dict[int, tuple[str | None, tuple[int, ...]]] = {}  # what each block's K/V encode
    held: list[str] = []
    for i, (family, n, lora, free) in enumerate(requests):
        seq = [family * 100 + t for t in range(n)]
        hit = bm.lookup_prefix(seq, lora)
        for b, block in enumerate(hit.block_ids):
            assert kv[block] == (lora, tuple(seq[: (b + 1) * 2]))
        if not bm.allocate(f"r{i}", n, hit, lora):
            continue
        for b, block in enumerate(bm.block_table(f"r{i}")[: n // 2]):
            kv[block] = (lora, tuple(seq[: (b + 1) * 2]))
        bm.cache_full_blocks(f"r{i}", seq, n)
        for event in bm.take_kv_events():
            if isinstance(event, BlockStored):  # the router's hashes of this prompt
                assert set(event.block_hashes) <= set(block_hashes(seq, 2, lora_name=lora))
        held.append(f"r{i}")
        if free:
            bm.free(held.pop())
        bm.check_invariants()
