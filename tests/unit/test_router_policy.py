"""Routing policies on their own: worked examples, determinism, and the bounds they promise."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.router.policy import (
    POLICIES,
    CacheAware,
    Candidate,
    LeastLoad,
    PowerOfTwo,
    RoundRobin,
    make_policy,
    rendezvous,
)


def test_cache_aware_worked_example_from_the_docstring() -> None:
    cands = [Candidate("a", 10, 0), Candidate("b", 200, 64), Candidate("c", 40, 96)]
    d = CacheAware().choose(cands, 128)
    assert d.replica == "c" and d.outcome == "cache_hit" and d.cached_tokens == 96
    assert d.ranking == ("c", "a", "b")  # costs 72, 138, 264


def test_cache_aware_keeps_a_warm_replica_until_its_load_exceeds_the_saving() -> None:
    policy = CacheAware()

    def warm(load: int) -> list[Candidate]:
        return [Candidate("a", load, 1000), Candidate("b", 0, 0)]

    assert policy.choose(warm(999), 1100).replica == "a"
    d = policy.choose(warm(1001), 1100)
    assert d.replica == "b" and d.outcome == "spill"


def test_cache_aware_imbalance_guard_leaves_the_warm_replica_early() -> None:
    # The saving (50k cached tokens) would keep "a"; the guard says a is 3x and 10k over the min.
    policy = CacheAware(abs_threshold=10_000, rel_threshold=1.5)
    cands = [Candidate("a", 15_001, 50_000), Candidate("b", 5_000, 0), Candidate("c", 6_000, 2_000)]
    d = policy.choose(cands, 60_000)
    assert (
        d.replica == "c" and d.outcome == "spill"
    )  # both in range: c saves more than its extra load


def test_cold_prompts_rotate_over_equal_replicas() -> None:
    policy = CacheAware()
    cands = [Candidate(n, 0) for n in "abc"]
    picks = [policy.choose(cands, 100) for _ in range(6)]
    assert [d.replica for d in picks] == list("abcabc")
    assert {d.outcome for d in picks} == {"cold"}


def test_a_new_group_goes_to_the_replica_owning_least_cache_among_the_lightly_loaded() -> None:
    cands = [Candidate("a", 0, 0, 900), Candidate("b", 50, 0, 10), Candidate("c", 5000, 0, 0)]
    d = CacheAware().choose(cands, 100)
    assert d.replica == "b" and d.outcome == "cold"  # c holds nothing but is far too loaded


def test_a_prompt_nobody_holds_goes_back_to_its_former_home_when_load_allows() -> None:
    # b held the prompt until it reported it evicted; a owns less cache and is lighter.
    home = [Candidate("a", 0, 0, 10), Candidate("b", 100, 0, 500, home_tokens=96)]
    d = CacheAware().choose(home, 128)
    assert d.replica == "b" and d.outcome == "cold"
    # Busier than the least loaded by more than the prompt: the home is not worth the wait.
    busy = [Candidate("a", 0, 0, 10), Candidate("b", 200, 0, 500, home_tokens=96)]
    assert CacheAware().choose(busy, 128).replica == "a"


def affine(key: int, loads: dict[str, int], held: int = 0) -> list[Candidate]:
    """Cold candidates as the cluster builds them: each with its rendezvous weight for `key`."""
    return [Candidate(n, load, 0, held, affinity=rendezvous(key, n)) for n, load in loads.items()]


def test_a_new_prompt_under_an_adapter_goes_where_the_adapter_ran_last_if_lightly_loaded() -> None:
    loads = {"a": 0, "b": 100, "c": 200, "d": 5000}
    for key in range(20):
        cands = [replace(c, adapter_warm=c.name == "c") for c in affine(key, loads)]
        d = CacheAware().choose(cands, 1000)
        assert d.replica == "c" and d.outcome == "cold"
        # Past the cold margin (256) the adapter's last replica is no choice: the hash decides.
        far = [replace(c, adapter_warm=c.name == "d") for c in affine(key, loads)]
        assert (
            CacheAware().choose(far, 1000).replica
            == CacheAware().choose(affine(key, loads), 1000).replica
        )


def test_the_adapters_last_replica_wins_ties_of_cost_and_nothing_more() -> None:
    tie = [Candidate("a", 10, 64), Candidate("b", 10, 64, adapter_warm=True)]
    policy = CacheAware()
    assert [policy.choose(tie, 128).replica for _ in range(3)] == ["b"] * 3
    cheaper = [Candidate("a", 0, 64), Candidate("b", 10, 64, adapter_warm=True)]
    assert CacheAware().choose(cheaper, 128).replica == "a"


def test_a_former_home_comes_before_the_adapters_last_replica() -> None:
    cands = [Candidate("a", 50, 0, home_tokens=64), Candidate("b", 0, 0, adapter_warm=True)]
    assert CacheAware().choose(cands, 128).replica == "a"


def test_with_no_sharing_seen_the_adapters_last_replica_still_takes_its_new_prompts() -> None:
    policy = CacheAware(unique_window=2)
    cold = [Candidate("a", 0), Candidate("b", 0)]
    policy.choose(cold, 100)
    policy.choose(cold, 100)
    assert not policy.sharing_seen()
    warm = [Candidate("a", 0), Candidate("b", 200, adapter_warm=True)]
    assert policy.choose(warm, 100).replica == "b"
    assert (
        policy.choose([Candidate("a", 0), Candidate("b", 300, adapter_warm=True)], 100).replica
        == "a"
    )


def test_rendezvous_weights_are_stable_and_a_removed_replica_moves_only_its_own_keys() -> None:
    # Pinned: the same in every process and release (routers on other hosts must agree).
    assert rendezvous(1, "http://a") == 18124880669863293595 != rendezvous(2, "http://a")
    names = [f"http://r{i}" for i in range(4)]

    def winner(key: int, among: list[str]) -> str:
        return max(among, key=lambda n: rendezvous(key, n))

    before = {k: winner(k, names) for k in range(400)}
    after = {k: winner(k, names[:3]) for k in range(400)}
    assert all(after[k] == before[k] for k in before if before[k] != names[3])
    # Spread: each replica wins about a quarter of the keys.
    assert all(60 < list(before.values()).count(n) < 140 for n in names)


def test_a_new_prompt_goes_to_its_rendezvous_winner_among_the_lightly_loaded() -> None:
    loads = {"a": 0, "b": 100, "c": 200, "d": 5000}
    for key in range(50):
        cands = affine(key, loads)
        eligible = [c for c in cands if c.load <= 256]  # the default cold margin
        d = CacheAware().choose(cands, 1000)
        assert d.outcome == "cold" and d.replica == max(eligible, key=lambda c: c.affinity).name
        # Two policies (two routers: their own tie rotations) agree on the same view.
        other = CacheAware()
        other.choose(affine(key + 1, loads), 1000)
        assert other.choose(cands, 1000).replica == d.replica
    # A margin of 0 is least-load's choice.
    assert CacheAware(cold_margin=0).choose(affine(7, loads), 1000).replica == "a"


def test_after_a_run_of_prompts_sharing_nothing_new_prompts_go_where_least_load_sends_them() -> (
    None
):
    # Routed in step with a LeastLoad (the same tie rotation): while the window fills, the
    # hash places new prompts among the lightly loaded; once the last 8 all found nothing
    # cached anywhere, each goes exactly where least-load sends it.
    policy, least = CacheAware(unique_window=8), LeastLoad()
    light = {"a": 0, "b": 0, "c": 96, "d": 2176}

    def both(key: int) -> tuple[str, str]:
        cands = affine(key, light)
        return policy.choose(cands, 1088).replica, least.choose(cands, 1088).replica

    first = [both(key) for key in range(8)]
    assert any(mine != theirs for mine, theirs in first)  # the hash, not least-load
    assert all(mine == theirs for mine, theirs in (both(key) for key in range(8, 40)))
    assert not policy.sharing_seen()
    # One prompt finds a cached prefix: new prompts may start groups again, the hash decides.
    hit = [Candidate("a", 0), Candidate("b", 0, 64), Candidate("c", 96), Candidate("d", 2176)]
    assert policy.choose(hit, 1088).outcome == "cache_hit"
    least.choose(hit, 1088)
    assert policy.sharing_seen()
    again = CacheAware(unique_window=8)
    assert [policy.choose(affine(k, light), 1088).replica for k in range(7)] == [
        again.choose(affine(k, light), 1088).replica for k in range(7)
    ]
    # Misses on prompts the replicas held before (a thrashing cluster: homes, no cached
    # tokens) are not prompts that share nothing: the hash keeps placing groups.
    thrash = CacheAware(unique_window=8)
    for key in range(20):
        cands = affine(key, light)
        cands[3] = Candidate("d", 2176, 0, 0, home_tokens=64, affinity=rendezvous(key, "d"))
        assert thrash.choose(cands, 1088).outcome == "cold"
    assert thrash.sharing_seen()


def test_round_robin_and_least_load() -> None:
    rr = RoundRobin()
    cands = [Candidate("a", 5), Candidate("b", 1), Candidate("c", 3)]
    assert [rr.choose(cands, 1).replica for _ in range(4)] == ["a", "b", "c", "a"]
    assert rr.choose(cands, 1).ranking == ("b", "c", "a")
    d = LeastLoad().choose(cands, 1)
    assert d.ranking == ("b", "c", "a") and d.outcome == "least_load"


def test_power_of_two_is_deterministic_with_a_seeded_rng() -> None:
    cands = [Candidate(str(i), i) for i in range(8)]
    runs = [
        [PowerOfTwo(random.Random(7)).choose(cands, 1).replica for _ in range(20)] for _ in range(2)
    ]
    assert runs[0] == runs[1]
    # Never the most loaded of all: it always loses its pair.
    p2 = PowerOfTwo(random.Random(1))
    assert all(p2.choose(cands, 1).replica != "7" for _ in range(200))


def test_make_policy_names_every_policy() -> None:
    for name in POLICIES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")  # type: ignore[arg-type]


# Some replicas are where the request's LoRA adapter ran last: the bounds hold all the same.
candidates = st.lists(
    st.tuples(st.integers(0, 100_000), st.integers(0, 4096), st.booleans()),
    min_size=1,
    max_size=8,
).map(
    lambda xs: [
        Candidate(f"r{i}", load, cached, adapter_warm=warm)
        for i, (load, cached, warm) in enumerate(xs)
    ]
)


@settings(deadline=None)  # a loaded 2-core box must not fail a pure test
@given(candidates, st.integers(4096, 8192), st.integers(0, 20_000), st.floats(1.0, 4.0))
def test_cache_aware_bounds_the_load_it_adds_to(
    cands: list[Candidate], prompt: int, abs_t: int, rel_t: float
) -> None:
    policy = CacheAware(abs_t, rel_t)
    d = policy.choose(cands, prompt)
    chosen = next(c for c in cands if c.name == d.replica)
    low = min(c.load for c in cands)
    # Never more loaded than the least loaded replica by more than the tokens its cache saves
    # (a prompt nobody holds: by more than the prompt)...
    assert chosen.load <= low + (chosen.cached_tokens if d.outcome != "cold" else prompt)
    # A new prompt: within the cold margin of the least loaded (least-load's balance).
    if d.outcome == "cold":
        assert chosen.load <= low + policy.cold_margin
    # ...and never past the imbalance margin while the cluster is imbalanced.
    if policy.imbalanced([c.load for c in cands]):
        assert chosen.load <= low + abs_t
    assert sorted(d.ranking) == sorted(c.name for c in cands)


cold_candidates = st.lists(
    st.tuples(st.integers(0, 3000), st.integers(0, 400), st.integers(0, 2**64 - 1)),
    min_size=1,
    max_size=8,
).map(
    lambda xs: [
        Candidate(f"r{i}", load, 0, held, affinity=weight)
        for i, (load, held, weight) in enumerate(xs)
    ]
)


@settings(deadline=None)  # a loaded 2-core box must not fail a pure test
@given(st.lists(cold_candidates, min_size=1, max_size=12), st.integers(16, 2048))
def test_prompts_sharing_nothing_go_within_the_margin_then_exactly_where_least_load_sends_them(
    rounds: list[list[Candidate]], prompt: int
) -> None:
    policy, least = CacheAware(unique_window=4), LeastLoad()
    for i, cands in enumerate(rounds):
        d, theirs = policy.choose(cands, prompt), least.choose(cands, prompt)
        chosen = next(c for c in cands if c.name == d.replica)
        assert d.outcome == "cold"
        assert chosen.load <= min(c.load for c in cands) + policy.cold_margin
        if i >= 4:  # the last 4 found nothing cached: least-load's choice, tie rotation too
            assert d.replica == theirs.replica


@settings(deadline=None)  # a loaded 2-core box must not fail a pure test
@given(candidates, st.sampled_from(POLICIES), st.integers(0, 99))
def test_every_policy_ranks_every_candidate_once(
    cands: list[Candidate], name: str, seed: int
) -> None:
    d = make_policy(name, random.Random(seed)).choose(cands, 100)  # type: ignore[arg-type]
    assert sorted(d.ranking) == sorted(c.name for c in cands)
    assert d.ranking[0] == d.replica
