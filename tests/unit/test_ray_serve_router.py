"""The Ray Serve path's pure parts: the builder's argument check and what the request router
reads from Serve. Skipped without the ray extra."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="the Ray Serve path needs the ray extra")

from inferd.kv_cache.block_hash import block_hashes
from inferd.router.ray_request_router import (
    CacheAwareRequestRouter,
    DispatchClock,
    _report,
    _token_ids,
)
from inferd.router.ray_serve import ForwardedRequest, app_builder


def test_the_builder_refuses_arguments_it_does_not_know() -> None:
    with pytest.raises(TypeError, match="num_replica"):
        app_builder({"num_replica": "2"})


def test_the_router_reads_the_prompt_from_the_forwarded_request() -> None:
    request = ForwardedRequest("POST", "/v1/completions", b"", (), b"{}", token_ids=(1, 2, 3))
    pending = SimpleNamespace(args=[request], kwargs={})
    assert _token_ids(pending) == (1, 2, 3)  # type: ignore[arg-type]
    assert _token_ids(None) == ()
    assert _token_ids(SimpleNamespace(args=["other"], kwargs={})) == ()  # type: ignore[arg-type]


def test_a_replicas_routing_stats_become_its_load_report() -> None:
    report = _report({"running": 2, "waiting": 1, "queued_prompt_tokens": 40, "num_blocks": 128})
    assert (report.running, report.waiting, report.queued_prompt_tokens) == (2, 1, 40)
    assert report.num_blocks == 128
    assert _report({}).num_blocks is None


def test_the_dispatch_clock_names_the_stamp_a_digest_could_show() -> None:
    clock = DispatchClock(size=2)
    assert clock.stamp_at(5.0) == 0
    for at, stamp in ((10.0, 5), (12.0, 9), (14.0, 20)):
        clock.record(at, stamp)
    assert (clock.stamp_at(11.0), clock.stamp_at(12.0), clock.stamp_at(99.0)) == (0, 9, 20)


def test_a_newer_digest_in_the_routing_stats_resets_the_index_once() -> None:
    # The router as Serve drives it: a request dispatched after the digest was taken keeps its
    # blocks; a digest read again (the same stats object) is not applied twice.
    router = CacheAwareRequestRouter.__new__(CacheAwareRequestRouter)
    router.initialize_state(block_size=4)
    cluster = router._cluster
    cluster.set_members(["r"])
    cluster.set_health("r", ready=True)
    old, new, placed_elsewhere = list(range(8)), list(range(100, 108)), list(range(50, 58))
    cluster.dispatch("r", cluster.route(old)).finish()
    router._clock.record(10.0, cluster.index.stamp)
    cluster.dispatch("r", cluster.route(new)).finish()
    router._clock.record(20.0, cluster.index.stamp)
    stats = {"digest_at": 15.0, "block_hashes": block_hashes(placed_elsewhere, 4)}
    router._apply_digest("r", stats)
    index = cluster.index
    assert index.match("r", block_hashes(old, 4)) == 0  # evicted: the digest lacks it
    assert index.match("r", block_hashes(new, 4)) == 2  # sent after the digest was taken
    assert index.match("r", block_hashes(placed_elsewhere, 4)) == 2
    index.insert("r", block_hashes(old, 4))
    router._apply_digest("r", stats)  # the same digest again: nothing changes
    assert index.match("r", block_hashes(old, 4)) == 2
