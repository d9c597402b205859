"""Traces reach a real OTLP/gRPC collector: one trace per request, one child span per stage.

The collector is the OTLP TraceService from opentelemetry-proto, served by grpcio in-process;
inferd's tracer exports to it with the real OTLP exporter (the `otel` extra)."""

from __future__ import annotations

from concurrent import futures
from typing import Any

import grpc
import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
    trace_service_pb2_grpc,
)

from inferd.telemetry.timeline import RequestTimeline
from inferd.telemetry.tracing import make_tracer
from inferd.types import RequestMetrics


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.resources: list[Any] = []

    def Export(self, request: Any, context: Any) -> Any:
        for rs in request.resource_spans:
            self.resources.append(rs.resource)
            for ss in rs.scope_spans:
                self.spans.extend(ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def test_request_trace_reaches_collector() -> None:
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        tracer = make_tracer(f"http://127.0.0.1:{port}")
        assert tracer is not None
        tl = RequestTimeline("req-42", arrival=100.0)
        tl.add("receive", 0.001, 100.0)
        tl.add("tokenize", 0.002, 100.001)
        tl.mark_enqueued(100.003)
        tl.update_from_engine(
            RequestMetrics(
                arrival_time=100.0,
                first_scheduled_time=100.01,
                first_token_time=100.05,
                finished_time=100.2,
            )
        )
        tl.finish(100.21)
        tracer.export(tl, {"inferd.prompt_tokens": 7})
        tracer.shutdown()  # flushes the batch processor
    finally:
        server.stop(0)
    by_name = {s.name: s for s in collector.spans}
    root = by_name["inferd.request"]
    assert {"inferd.receive", "inferd.tokenize", "inferd.queue", "inferd.prefill"} <= set(by_name)
    assert "inferd.decode" in by_name
    for name, span in by_name.items():
        assert span.trace_id == root.trace_id
        if name != "inferd.request":
            assert span.parent_span_id == root.span_id
    prefill = by_name["inferd.prefill"]
    assert (prefill.end_time_unix_nano - prefill.start_time_unix_nano) == pytest.approx(
        4e7, rel=1e-3
    )
    attrs = {a.key: a.value for a in root.attributes}
    assert attrs["inferd.request_id"].string_value == "req-42"
    assert attrs["inferd.prompt_tokens"].int_value == 7
    service = {a.key: a.value.string_value for a in collector.resources[0].attributes}
    assert service["service.name"] == "inferd"
