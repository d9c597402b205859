"""Prefix-cache accounting in the scheduler (faked model): queried and hit prompt tokens, counted
once per request at its first admission, and each request's own `num_cached_tokens`."""

from __future__ import annotations

from test_scheduler import make_request, make_scheduler, run_to_completion, step

from inferd.engine.info import EngineInfo, EngineStats
from inferd.gateway.state import gauges_from_stats
from inferd.scheduler.request import RequestStatus
from inferd.telemetry.metrics import ServerMetrics, parse_samples

SHARED = list(range(1, 13))  # 3 full blocks of 4 tokens


def test_a_second_request_with_a_shared_prefix_counts_its_cached_tokens() -> None:
    s = make_scheduler()
    a = make_request("a", [*SHARED, 50, 51])
    s.add_request(a)
    run_to_completion(s)
    assert a.num_cached_tokens == 0
    assert (s.prefix_cache.queries, s.prefix_cache.hits) == (14, 0)
    b = make_request("b", [*SHARED, 60, 61])
    s.add_request(b)
    out, _ = step(s)
    assert out.chunks[0].start == 12 and b.num_cached_tokens == 12
    assert (s.prefix_cache.queries, s.prefix_cache.hits) == (28, 12)


def test_the_last_prompt_token_is_never_counted_as_cached() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", SHARED))
    run_to_completion(s)
    c = make_request("c", SHARED)  # 3 whole blocks: the hit stops one block short
    s.add_request(c)
    step(s)
    assert c.num_cached_tokens == 8 and s.prefix_cache.hits == 8


def test_nothing_is_queried_with_prefix_caching_off() -> None:
    s = make_scheduler(prefix=False)
    for rid in ("a", "b"):
        r = make_request(rid, [*SHARED, 50])
        s.add_request(r)
        run_to_completion(s)
        assert r.num_cached_tokens == 0
    assert (s.prefix_cache.queries, s.prefix_cache.hits) == (0, 0)


def test_a_request_not_yet_admitted_has_no_cached_count() -> None:
    s = make_scheduler(max_seqs=1)
    s.add_request(make_request("a", 4, max_tokens=8))
    late = make_request("late", 4)
    s.add_request(late)
    step(s)
    assert late.num_cached_tokens is None and s.prefix_cache.queries == 4


def test_a_preempted_request_keeps_its_first_cached_count() -> None:
    s = make_scheduler(num_blocks=6)
    shared = [7, 7, 7, 7]
    warm = make_request("warm", [*shared, 9], max_tokens=1)
    s.add_request(warm)
    run_to_completion(s)  # `shared` is now one cached, evictable block
    a = make_request("a", 8, max_tokens=6, priority=0, arrival=0)
    b = make_request("b", [*shared, 30, 31, 32, 33], max_tokens=6, priority=1, arrival=1)
    c = make_request("c", 8, max_tokens=6, priority=0, arrival=2)
    for r in (a, b, c):
        s.add_request(r)
    step(s)  # all three fit: 6 blocks, b's first one revived from the cache
    assert b.num_cached_tokens == 4
    counted = (s.prefix_cache.queries, s.prefix_cache.hits)
    assert counted == (5 + 24, 4)
    out, _ = step(s)  # every decode needs a new block: b (lowest priority) is preempted
    assert out.preempted_ids == ["b"]
    run_to_completion(s)
    # Re-admitted after recompute with its own blocks possibly cached: neither changes.
    assert b.status is RequestStatus.FINISHED_LENGTH and b.num_preemptions == 1
    assert b.num_cached_tokens == 4
    assert (s.prefix_cache.queries, s.prefix_cache.hits) == counted


def test_the_counters_and_the_cache_config_reach_prometheus() -> None:
    info = EngineInfo("m", "Llama", "cpu", "float32", 64, 100, 16, 32, True, "bfloat16")
    stats = EngineStats(
        prefix_cache_queries_tokens_total=40,
        prefix_cache_hits_tokens_total=32,
        cache_config=info.cache_config_labels(),
    )
    metrics = ServerMetrics(lambda: gauges_from_stats(stats))
    samples = parse_samples(metrics.render().decode())
    assert samples["inferd_prefix_cache_queries_tokens_total"] == 40
    assert samples["inferd_prefix_cache_hits_tokens_total"] == 32
    labels = 'block_size="16",cache_dtype="bfloat16",enable_prefix_caching="True",num_blocks="100"'
    assert samples["inferd_cache_config_info{" + labels + "}"] == 1


def test_no_cache_config_info_before_the_engine_has_loaded() -> None:
    text = ServerMetrics(lambda: None).render().decode()
    assert "inferd_cache_config_info" not in text
    assert parse_samples(text)["inferd_prefix_cache_hits_tokens_total"] == 0
