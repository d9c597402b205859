"""RequestLog: bounds, tail sampling (slowest and failed kept after the recent list rolls over),
filters; RequestRecord's waterfall JSON: offsets, the exclusive path that sums to e2e, token
ticks; records built from an LLM timeline and from the classic pipeline's report."""

from __future__ import annotations

import pytest

from inferd.telemetry.request_log import (
    RequestContext,
    RequestLog,
    RequestRecord,
    current_request,
    llm_record,
)
from inferd.telemetry.stages import Stage, StageTimings
from inferd.telemetry.timeline import RequestTimeline


def _record(rid: str, e2e: float, status: str = "ok", model: str = "m") -> RequestRecord:
    stages = StageTimings()
    stages.add(Stage.QUEUE, e2e / 2, start=100.0)
    return RequestRecord(rid, "llm", model, status, arrival=100.0, e2e=e2e, stages=stages)


def test_recent_is_bounded_and_newest_first() -> None:
    log = RequestLog(capacity=3, keep_failed=0, keep_slowest=0)
    for i in range(5):
        log.add(_record(f"r{i}", 0.01))
    assert [r.request_id for r in log.recent()] == ["r4", "r3", "r2"]
    assert len(log) == 3 and log.total == 5


def test_slowest_and_failed_survive_the_recent_list_rolling_over() -> None:
    log = RequestLog(capacity=4, keep_failed=2, keep_slowest=1)
    log.add(_record("slow", 9.0))
    log.add(_record("bad", 0.01, status="timeout"))
    for i in range(20):
        log.add(_record(f"r{i}", 0.01))
    kept = {r.request_id for r in log.retained()}
    assert {"slow", "bad"} <= kept
    assert len(kept) == 4 + 2  # recent + slowest + failed, nothing else
    assert log.get("slow") is not None and log.get("bad") is not None
    assert log.get("r0") is None


def test_slowest_window_turns_over(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("inferd.telemetry.request_log.time.monotonic", lambda: now[0])
    log = RequestLog(capacity=1, keep_failed=0, keep_slowest=1, window_s=10.0)
    log.add(_record("old-slow", 5.0))
    now[0] += 11  # next window: the previous window's slowest is still kept
    log.add(_record("a", 0.1))
    assert log.get("old-slow") is not None
    now[0] += 25  # two windows later: gone
    log.add(_record("b", 0.1))
    assert log.get("old-slow") is None


def test_filters_and_slowest_first() -> None:
    log = RequestLog()
    log.add(_record("a", 0.3, model="x"))
    log.add(_record("b", 0.9, model="y", status="error"))
    log.add(_record("c", 0.5, model="x"))
    assert [r.request_id for r in log.recent(model="x")] == ["c", "a"]
    assert [r.request_id for r in log.recent(status="failed")] == ["b"]
    assert [r.request_id for r in log.recent(status="ok", slowest=True)] == ["c", "a"]
    assert [r.request_id for r in log.recent(slowest=True, limit=1)] == ["b"]


def test_waterfall_path_tiles_e2e_with_other_for_gaps() -> None:
    stages = StageTimings()
    stages.add(Stage.RECEIVE, 0.1, start=10.0)
    stages.add(Stage.QUEUE, 0.2, start=10.2)  # gap 0.1 .. 0.2 is "other"
    stages.add(Stage.DECODE, 0.5, start=10.4)
    stages.add(Stage.DETOKENIZE, 0.1, start=10.4)  # nested in decode
    rec = RequestRecord("r", "llm", "m", "ok", arrival=10.0, e2e=1.0, stages=stages)
    doc = rec.timeline()
    rows = {row["stage"]: row for row in doc["stages"]}  # type: ignore[attr-defined]
    assert rows["queue"]["start"] == pytest.approx(0.2)
    assert rows["detokenize"]["seconds"] == pytest.approx(0.1)
    path = doc["path"]
    assert [p["stage"] for p in path] == [  # type: ignore[attr-defined]
        "receive",
        "other",
        "queue",
        "other",
        "decode",
        "other",
    ]
    assert sum(p["seconds"] for p in path) == pytest.approx(1.0, abs=1e-5)  # type: ignore[attr-defined]


def test_llm_record_from_timeline_has_token_ticks() -> None:
    tl = RequestTimeline("req-7", arrival=0.0)
    tl.add(Stage.RECEIVE, 0.01, 0.0)
    tl.mark_enqueued(0.02)
    tl.first_scheduled, tl.first_token, tl.engine_finished = 0.05, 0.1, 0.4
    tl.on_tokens(1, now=0.1)
    tl.on_tokens(2, now=0.3)  # two tokens in one delivery: the gap is shared
    tl.on_tokens(1, now=0.4)
    tl.finish(0.45)
    rec = llm_record(tl, "tiny", 5, ["stop"])
    assert rec.request_id == "req-7" and rec.status == "ok" and not rec.failed
    assert rec.e2e == pytest.approx(0.45) and rec.output_tokens == 4
    assert rec.token_ticks() == pytest.approx([0.1, 0.2, 0.3, 0.4])
    doc = rec.timeline()
    assert [s["stage"] for s in doc["stages"]] == [  # type: ignore[attr-defined]
        "receive",
        "queue",
        "prefill",
        "decode",
    ]
    assert sum(p["seconds"] for p in doc["path"]) == pytest.approx(0.45, abs=1e-5)  # type: ignore[attr-defined]


def test_llm_failure_carries_its_reason() -> None:
    tl = RequestTimeline("t", arrival=0.0)
    tl.finish(1.0)
    rec = llm_record(tl, "tiny", 1, ["stop", "timeout"])
    assert rec.failed and rec.status == "timeout" and "timeout" in (rec.error or "")


def test_classic_record_uses_the_request_context_and_the_raised_error() -> None:
    log = RequestLog()
    token = current_request.set(RequestContext("cls-1", arrival=0.0))
    try:
        try:
            raise ValueError("input 'x' has shape [3], expected [4]")
        except ValueError:
            log.add_classic("fraud", StageTimings.from_mapping({"validate": 0.001}), "invalid")
        timings = {"validate": 0.001, "queue": 0.01, "infer": 0.02}
        log.add_classic("fraud", StageTimings.from_mapping(timings), "success")
        log.finish_classic(receive_s=0.002, stream_s=0.003)
    finally:
        current_request.reset(token)
    ok, failed = log.recent()
    assert failed.status == "invalid" and "expected [4]" in (failed.error or "")
    assert ok.request_id == "cls-1" and ok.status == "ok"
    doc = ok.timeline()
    names = [s["stage"] for s in doc["stages"]]  # type: ignore[attr-defined]
    assert names == ["receive", "validate", "queue", "infer", "stream"]
    assert sum(p["seconds"] for p in doc["path"]) == pytest.approx(ok.e2e, abs=1e-5)  # type: ignore[attr-defined]


def test_llm_record_shows_the_trace_the_tracer_exported_after_it() -> None:
    sdk = pytest.importorskip("opentelemetry.sdk.trace", reason="needs the otel extra")
    from inferd.telemetry.tracing import RequestTracer

    tl = RequestTimeline("traced", arrival=0.0)
    tl.finish(0.5)
    rec = llm_record(tl, "tiny", 1, ["stop"])  # metrics observe first, the tracer exports after
    assert rec.timeline()["trace_id"] is None
    RequestTracer(sdk.TracerProvider().get_tracer("test")).export(tl)
    trace_id = rec.timeline()["trace_id"]
    assert isinstance(trace_id, str) and len(trace_id) == 32 and int(trace_id, 16) != 0
