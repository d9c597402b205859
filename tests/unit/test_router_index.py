"""The stable block hash and the router's approximate, LRU-bounded prefix index."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.kv_cache.block_hash import block_hashes
from inferd.router.digest_pacer import DigestPacer
from inferd.router.index import PrefixIndex

tokens = st.lists(st.integers(0, 2**32 - 1), max_size=80)


def test_hash_is_pinned_across_processes_and_seeds() -> None:
    # A golden value: a change here changes every replica's and router's keys (bump the seed).
    assert block_hashes([1, 2, 3, 4], 2) == [13462678241772528940, 17882284097655085562]
    code = "from inferd.kv_cache.block_hash import block_hashes; print(block_hashes([1,2,3,4],2))"
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.stdout.strip() == "[13462678241772528940, 17882284097655085562]"


def test_only_full_blocks_and_at_most_max_blocks() -> None:
    assert block_hashes(list(range(15)), 16) == []
    assert len(block_hashes(list(range(100)), 16)) == 6
    assert len(block_hashes(list(range(100)), 16, max_blocks=2)) == 2


@settings(deadline=None)  # a loaded 2-core box must not fail a pure test
@given(tokens, tokens, st.integers(1, 8))
def test_hashes_agree_exactly_on_the_common_full_block_prefix(
    a: list[int], b: list[int], bs: int
) -> None:
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    ha, hb = block_hashes(a, bs), block_hashes(b, bs)
    shared = 0
    while shared < min(len(ha), len(hb)) and ha[shared] == hb[shared]:
        shared += 1
    assert shared == min(common // bs, len(ha), len(hb))


def test_a_block_hash_depends_on_its_whole_prefix() -> None:
    # Same second block, different first block: the chain makes the second hashes differ too.
    assert block_hashes([1, 2, 5, 6], 2)[1] != block_hashes([3, 4, 5, 6], 2)[1]


def test_match_counts_leading_blocks_only() -> None:
    index = PrefixIndex(100)
    index.insert("a", [1, 2, 3])
    assert index.match("a", [1, 2, 9, 3]) == 2
    assert index.match("a", [9, 1, 2]) == 0
    assert index.match("b", [1]) == 0


def test_lru_evicts_leaves_before_the_prefix_they_extend() -> None:
    index = PrefixIndex(4)
    index.insert("a", [1, 2, 3])  # shared prefix 1, 2 then leaf 3
    index.insert("a", [1, 2, 4])  # touches 1, 2 again, adds leaf 4
    index.insert("a", [1, 5])  # one over capacity: the oldest leaf (3) goes, not the prefix
    assert index.match("a", [1, 2, 4]) == 3
    assert index.match("a", [1, 2, 3]) == 2
    assert index.evictions == 1


@settings(deadline=None)  # a loaded 2-core box must not fail a pure test
@given(st.lists(st.lists(st.integers(0, 50), max_size=12), max_size=30), st.integers(1, 20))
def test_memory_is_bounded_and_a_fresh_insert_always_matches_in_full(
    prompts: list[list[int]], cap: int
) -> None:
    index = PrefixIndex(cap)
    for p in prompts:
        hashes = list(dict.fromkeys(p))  # distinct, as chained hashes are
        index.insert("r", hashes)
        assert index.size("r") <= cap
        assert index.match("r", hashes) == min(len(hashes), cap)


def test_forget_drops_a_replica() -> None:
    index = PrefixIndex(10)
    index.insert("a", [1, 2])
    index.forget("a")
    assert index.match("a", [1, 2]) == 0 and index.size("a") == 0


def test_a_replica_known_to_hold_fewer_blocks_gets_a_smaller_index() -> None:
    index = PrefixIndex(10)
    index.set_capacity("small", 2)
    index.set_capacity("huge", 1000)  # never above the router's own bound
    index.insert("small", [1, 2, 3])
    index.insert("huge", list(range(20)))
    assert (index.size("small"), index.size("huge")) == (2, 10)
    assert index.match("small", [1, 2, 3]) == 2  # the prefix stayed, the leaf went


def test_a_reported_eviction_drops_what_the_index_touched_no_later_into_ghosts() -> None:
    index = PrefixIndex(10)
    index.insert("a", [5, 6])
    index.insert("a", [1, 2, 3])
    claim = index.stamps("a", [1, 2, 3])  # at dispatch, before the insert re-stamps them
    assert len(claim) == 3 and claim[0] > claim[1] > claim[2]  # the prefix is the most recent
    index.insert("a", [1, 2, 3])
    assert index.drop_through("a", claim[1]) == 2  # reported 1 block: 5 and 6 were older
    assert index.match("a", [1, 2, 3]) == 3  # re-stamped at dispatch: just computed again
    assert index.match("a", [5, 6]) == 0 and index.size("a") == 3
    assert index.home("a", [5, 6]) == 2 and index.home("b", [5, 6]) == 0
    index.insert("a", [5])  # live again: a hit, no longer a ghost
    assert index.match("a", [5, 6]) == 1 and index.home("a", [5, 6]) == 2


def test_an_exact_replica_is_never_corrected_from_reports() -> None:
    index = PrefixIndex(10)
    index.follow_events("a")
    index.stored("a", [1, 2])
    assert index.drop_through("a", index.stamp) == 0 and index.match("a", [1, 2]) == 2


def test_ghosts_are_bounded_by_the_replicas_capacity() -> None:
    index = PrefixIndex(3)
    for h in range(6):
        index.insert("a", [h])
        index.drop_through("a", index.stamp)
    assert index.size("a") == 0
    assert [index.home("a", [h]) for h in range(6)] == [0, 0, 0, 1, 1, 1]


def test_a_block_digest_resets_the_index_but_keeps_what_was_sent_since() -> None:
    index = PrefixIndex(10)
    index.insert("a", [1, 2])
    since = index.stamp  # asked for the digest here; [7] is dispatched before it answers
    index.insert("a", [7])
    # The replica evicted 2 and holds 5, which another router placed there.
    assert index.snapshot("a", [5, 1], since, num_recent=2) == 1
    assert (index.match("a", [5]), index.match("a", [1, 2]), index.match("a", [7])) == (1, 1, 1)
    assert index.home("a", [1, 2]) == 2  # 2 is a ghost: the prefix's former home
    # The router's own newer block is the most recent, the digest's order behind it (LRU).
    index.set_capacity("a", 2)
    index.insert("a", [9])
    assert (index.match("a", [5]), index.match("a", [7]), index.match("a", [9])) == (0, 1, 1)


def test_digest_blocks_no_request_holds_or_touched_do_not_count_as_owned() -> None:
    # A past workload's leftovers match, but they are no share of the groups; blocks used
    # lately (someone else's traffic) and blocks the router sent there are.
    index = PrefixIndex(10)
    index.insert("a", [1])
    assert index.snapshot("a", [8, 9, 5, 1], index.stamp, num_recent=2) == 0
    assert (index.size("a"), index.owned("a")) == (4, 2)  # 8, 9 stale; 5 in use; 1 the router's
    assert index.match("a", [8]) == 1
    index.insert("a", [8])  # a request touched it: live
    assert index.owned("a") == 3
    # An older digest's stale block the router never touched stays stale; one shown used, live.
    index.snapshot("a", [9, 8, 5, 1], index.stamp, num_recent=0)
    assert index.owned("a") == 3
    index.snapshot("a", [8, 5, 1, 9], index.stamp, num_recent=1)
    assert index.owned("a") == 4
    # Evicted or dropped stale blocks leave the count with them.
    index.set_capacity("a", 1)
    index.insert("a", [7])
    assert (index.size("a"), index.owned("a")) == (1, 1)


def test_a_block_digest_is_bounded_and_ignored_for_an_exact_replica() -> None:
    index = PrefixIndex(3)
    index.snapshot("a", list(range(10)), index.stamp, num_recent=10)
    assert index.size("a") == 3 and index.match("a", [9]) == 1  # the most recent ones
    index.follow_events("b")
    index.stored("b", [1])
    assert index.snapshot("b", [2], index.stamp, 1) == 0 and index.match("b", [1]) == 1


def _serve(truth: OrderedDict[int, None], hashes: list[int], capacity: int) -> int:
    """The replica: an LRU of `capacity` blocks touched tail first, as the engine's."""
    hit = 0
    while hit < len(hashes) and hashes[hit] in truth:
        hit += 1
    for h in reversed(hashes):
        truth[h] = None
        truth.move_to_end(h)
    while len(truth) > capacity:
        truth.popitem(last=False)
    return hit


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6)), min_size=1, max_size=40),
    st.integers(2, 12),
    st.integers(0, 12),
)
def test_corrections_drop_only_what_the_replica_evicted(
    prompts: list[tuple[int, int]], true_cap: int, extra: int
) -> None:
    # An index larger than the replica's cache over-claims; the reports correct it, and never
    # drop a block the replica still holds (requests one after another, as one router sees them).
    index = PrefixIndex(true_cap + extra)
    truth: OrderedDict[int, None] = OrderedDict()
    for group, length in prompts:
        hashes = [group * 100 + i for i in range(length)]
        claim = index.stamps("r", hashes)
        index.insert("r", hashes)
        hit = _serve(truth, hashes, true_cap)
        if hit < len(claim):
            index.drop_through("r", claim[hit])
        assert set(truth) <= {h for h in range(600) if index.match("r", [h]) == 1}


def test_digests_that_take_long_are_paced_to_a_share_of_the_routers_time() -> None:
    pacer = DigestPacer(interval_s=2.0)
    assert pacer.due("a", now=0.0) and pacer.recent_s("a") == 4.0
    assert pacer.applied("a", now=0.0, cost_s=0.001, replicas=8) == 2.0  # cheap: every check
    assert pacer.due("a", now=0.1)
    assert pacer.applied("a", now=0.0, cost_s=0.05, replicas=8) == 8.0  # 8 x 50 ms = 5 % of 8 s
    assert not pacer.due("a", now=2.0) and pacer.due("a", now=7.5)
    assert pacer.recent_s("a") == 16.0
    pacer.forget("a")
    assert pacer.due("a", now=0.0) and pacer.recent_s("a") == 4.0
