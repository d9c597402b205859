"""The classic models' Prometheus metrics and Triton statistics (telemetry/model_metrics.py):
series per model, created when first observed, counting every observation."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from inferd.telemetry.model_metrics import ModelMetrics
from inferd.telemetry.stages import Stage, StageTimings


def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_each_observation_counts_under_its_own_model() -> None:
    registry = CollectorRegistry()
    metrics = ModelMetrics(registry)
    timings = StageTimings({Stage.QUEUE: 0.002, Stage.INFER: 0.001})
    for _ in range(3):
        metrics.observe_request("a", timings, "success")
    metrics.observe_request("b", timings, "invalid")
    metrics.observe_request("a", StageTimings({Stage.VALIDATE: 0.0}), "mystery")
    metrics.observe_gateway("a", 0.001, 0.0005)

    requests = "inferd_model_requests_total"
    assert _sample(registry, requests, model="a", outcome="success") == 3
    assert _sample(registry, requests, model="a", outcome="error") == 1  # unknown outcomes
    assert _sample(registry, requests, model="b", outcome="invalid") == 1
    queue = "inferd_model_queue_seconds_count"
    assert _sample(registry, queue, model="a") == 3
    assert _sample(registry, queue, model="b") == 1
    assert _sample(registry, "inferd_model_queue_seconds_sum", model="a") == pytest.approx(0.006)
    assert _sample(registry, "inferd_model_receive_seconds_count", model="a") == 1
    assert _sample(registry, "inferd_model_stream_seconds_count", model="a") == 1
    # A series exists only once observed: nothing was counted for it.
    assert _sample(registry, requests, model="b", outcome="success") is None
    assert _sample(registry, "inferd_model_preprocess_seconds_count", model="a") is None
    assert _sample(registry, "inferd_model_receive_seconds_count", model="b") is None


def test_statistics_follow_the_cached_series() -> None:
    metrics = ModelMetrics(CollectorRegistry())
    metrics.observe_request("a", StageTimings({Stage.INFER: 0.001}), "success")
    metrics.observe_batch("a", 4, 0.0)
    metrics.observe_request("a", StageTimings({Stage.INFER: 0.001}), "success")
    (stats,) = metrics.statistics([("a", "1")])["model_stats"]
    assert stats["inference_stats"]["success"]["count"] == 2
    assert stats["inference_stats"]["compute_infer"]["ns"] == 2_000_000
    assert (stats["inference_count"], stats["execution_count"]) == (4, 1)
