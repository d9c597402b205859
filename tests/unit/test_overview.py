"""The dashboard overview: nearest-rank percentiles, exclusive stage seconds that add up to the
summed e2e, window means of the classic batch histograms, and one snapshot of both lanes."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry, Histogram

from inferd.telemetry.metrics import EngineGauges
from inferd.telemetry.overview import (
    BatchTotals,
    HistogramTotals,
    overview,
    percentiles,
    stage_seconds,
)
from inferd.telemetry.request_log import Lane, RequestLog, RequestRecord
from inferd.telemetry.stages import Stage, StageTimings


def _record(lane: Lane, model: str, e2e: float, status: str = "ok") -> RequestRecord:
    now = time.monotonic()
    stages = StageTimings()
    first = Stage.QUEUE
    second = Stage.DECODE if lane == "llm" else Stage.INFER
    stages.add(first, e2e / 4, start=now - e2e)
    stages.add(second, e2e / 2, start=now - e2e / 2)
    return RequestRecord(
        "r",
        lane,
        model,
        status,
        arrival=now - e2e,
        e2e=e2e,
        stages=stages,
        output_tokens=10,
        token_gaps=[0.01] * 9,
        last_token_at=now,
        ttft=e2e / 2,
    )


def test_percentiles_nearest_rank() -> None:
    assert percentiles([]) is None
    assert percentiles([3.0]) == {"p50": 3.0, "p90": 3.0, "p99": 3.0}
    values = [float(i) for i in range(1, 101)]
    assert percentiles(values) == {"p50": 50.0, "p90": 90.0, "p99": 99.0}


def test_stage_seconds_add_up_to_the_summed_e2e() -> None:
    records = [_record("llm", "m", 1.0), _record("llm", "m", 2.0)]
    shares = stage_seconds(records)
    assert shares["queue"] == pytest.approx(0.75)
    assert shares["decode"] == pytest.approx(1.5)
    assert sum(shares.values()) == pytest.approx(3.0)


def test_histogram_means_over_a_window() -> None:
    hist = Histogram("rows", "rows", ["model"], registry=CollectorRegistry())
    hist.labels("a").observe(2)
    before = HistogramTotals.read(hist)
    hist.labels("a").observe(8)
    hist.labels("a").observe(4)
    now = HistogramTotals.read(hist)
    assert now.mean_since(None, "a") == pytest.approx(14 / 3, abs=1e-3)
    assert now.mean_since(before, "a") == pytest.approx(6.0)
    assert now.mean_since(now, "a") is None
    assert now.mean_since(None, "b") is None


def test_overview_of_both_lanes() -> None:
    log = RequestLog()
    log.add(_record("llm", "tiny", 0.4))
    log.add(_record("llm", "tiny", 0.2, status="timeout"))
    log.add(_record("classic", "fraud", 0.01))
    registry = CollectorRegistry()
    rows = Histogram("rows", "rows", ["model"], registry=registry)
    pad = Histogram("pad", "pad", ["model"], registry=registry)
    rows.labels("fraud").observe(3)
    pad.labels("fraud").observe(0.25)
    totals = BatchTotals(0.0, HistogramTotals.read(rows), HistogramTotals.read(pad))
    o = overview(log, 10.0, EngineGauges(running=2, waiting=1, queued=3), (totals, None), "tiny")
    llm, classic = o["llm"], o["classic"]
    assert isinstance(llm, dict) and isinstance(classic, dict)
    assert llm["requests"] == 2 and llm["failed"] == 1 and llm["rps"] == pytest.approx(0.2)
    assert llm["output_tps"] == pytest.approx(2.0)
    assert llm["itl"] == {"p50": 0.01, "p90": 0.01, "p99": 0.01}
    assert llm["engine"]["queue_depth"] == 4 and llm["engine"]["running"] == 2
    assert set(llm["stage_seconds"]) <= set(llm["stage_order"])
    fraud = classic["models"]["fraud"]
    assert fraud["batch_rows"] == 3.0 and fraud["padding_ratio"] == 0.25
    assert fraud["queue_s"] == pytest.approx(0.0025) and fraud["compute_s"] == pytest.approx(0.005)


def _totals(at: float, queries: int, hits: int) -> BatchTotals:
    registry = CollectorRegistry()
    empty = HistogramTotals.read(Histogram("h", "h", ["model"], registry=registry))
    return BatchTotals(at, empty, empty, prefix_queries=queries, prefix_hits=hits)


@pytest.mark.parametrize(
    ("newest", "oldest", "rate"),
    [
        ((100, 25), None, 0.25),  # no older snapshot yet: since start
        ((300, 175), (100, 25), 0.75),  # over the window: 150 of 200 new prompt tokens hit
        ((100, 25), (100, 25), 0.25),  # nothing looked up in the window: the rate since start
        ((0, 0), None, None),  # nothing looked up at all: n/a
    ],
)
def test_prefix_cache_hit_rate_over_the_window(
    newest: tuple[int, int], oldest: tuple[int, int] | None, rate: float | None
) -> None:
    now = _totals(10.0, *newest)
    before = None if oldest is None else _totals(0.0, *oldest)
    o = overview(RequestLog(), 60.0, EngineGauges(), (now, before), "tiny")
    llm = o["llm"]
    assert isinstance(llm, dict)
    assert llm["engine"]["prefix_cache_hit_rate"] == rate


def test_lane_series_buckets_rate_and_latency_by_finish_time() -> None:
    from inferd.telemetry.overview import BUCKETS, lane_series

    now = 1000.0

    def finished(at: float, e2e: float, tokens: int) -> RequestRecord:
        return RequestRecord(
            "r", "llm", "m", "ok", arrival=at - e2e, e2e=e2e, stages=StageTimings(),
            output_tokens=tokens, ttft=e2e / 2,
        )  # fmt: skip

    # A 60 s window: 2 s buckets. Two requests end in the last bucket, one in the first.
    records = [finished(941.0, 0.4, 10), finished(999.0, 0.2, 4), finished(999.5, 0.8, 6)]
    s = lane_series(records, 60.0, now, lambda r: r.output_tokens, lambda r: r.ttft)
    assert s["bucket_s"] == 2.0
    rate, p50, p99 = s["rate"], s["p50"], s["p99"]
    assert isinstance(rate, list) and isinstance(p50, list) and isinstance(p99, list)
    assert len(rate) == BUCKETS and rate[0] == 5.0 and rate[-1] == 5.0 and sum(rate) == 10.0
    assert (p50[0], p99[0]) == (0.2, 0.2)
    assert (p50[-1], p99[-1]) == (0.1, 0.4)
    assert p50[1:-1] == [None] * (BUCKETS - 2)
