"""The Ray Serve path's pure parts: the builder's argument check and what the request router
reads from Serve. Skipped without the ray extra."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="the Ray Serve path needs the ray extra")

from inferd.router.ray_serve import ForwardedRequest, _report, _token_ids, app_builder


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
