"""OpenTelemetry: one trace per request, one span per stage, built from its timeline at the end.

Off unless `--otlp-traces-endpoint` is set: then `make_tracer` returns None, nothing from
opentelemetry is imported, and the request path pays one `is None` check. When on, spans are
created after the request finished (from RequestTimeline's recorded instants) and handed to a
BatchSpanProcessor, whose export runs on its own thread, off the event loop.

A request that arrives with a W3C `traceparent` header (as `inferd router` sends one) gets its
`inferd.request` span as a child of that remote span, so one trace shows the router's decision
and the replica's stages.

Needs the `otel` extra: `pip install 'inferd[otel]'`.
"""

from __future__ import annotations

import time
from typing import Any

from inferd.telemetry.stages import ordered
from inferd.telemetry.timeline import RequestTimeline


def _to_epoch_ns(monotonic_s: float, offset_ns: int) -> int:
    return int(monotonic_s * 1e9) + offset_ns


class RequestTracer:
    """Turns finished RequestTimelines into spans on an OTel tracer."""

    def __init__(self, tracer: Any, provider: Any = None) -> None:
        self._tracer = tracer
        self._provider = provider
        # CLOCK_MONOTONIC -> Unix epoch, fixed at start (spans want wall-clock nanoseconds).
        self._offset_ns = time.time_ns() - time.monotonic_ns()

    def export(self, timeline: RequestTimeline, attributes: dict[str, Any] | None = None) -> None:
        end = timeline.finished if timeline.finished is not None else time.monotonic()
        root = self._tracer.start_span(
            "inferd.request",
            context=remote_parent(timeline.traceparent),
            start_time=_to_epoch_ns(timeline.arrival, self._offset_ns),
            attributes={"inferd.request_id": timeline.request_id, **(attributes or {})},
        )
        timeline.trace_id = format(root.get_span_context().trace_id, "032x")
        try:
            self._stage_spans(root, timeline)
        finally:
            root.end(end_time=_to_epoch_ns(end, self._offset_ns))

    def _stage_spans(self, root: Any, timeline: RequestTimeline) -> None:
        from opentelemetry import trace

        ctx = trace.set_span_in_context(root)
        stages = timeline.all_stages()
        for stage in ordered(stages.seconds):
            if stage not in stages.starts:
                continue
            seconds = round(stages.seconds[stage], 6)
            start = _to_epoch_ns(stages.starts[stage], self._offset_ns)
            span = self._tracer.start_span(f"inferd.{stage}", context=ctx, start_time=start)
            span.set_attribute("inferd.stage_seconds", seconds)
            span.end(end_time=start + int(seconds * 1e9))

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()


def remote_parent(traceparent: str | None) -> Any:
    """The OTel context a W3C `traceparent` header names, as the parent of a new span; None (the
    span starts a trace of its own) without one. A malformed header parses to an empty context,
    which also starts a new trace: the W3C rule, never an error for the request."""
    if not traceparent:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": traceparent})


def make_tracer(endpoint: str | None, service_name: str = "inferd") -> RequestTracer | None:
    """None when tracing is off. Raises ImportError (with the fix) when the extra is missing."""
    if not endpoint:
        return None
    provider = otlp_provider(endpoint, service_name)
    return RequestTracer(provider.get_tracer("inferd"), provider)


def otlp_provider(endpoint: str, service_name: str) -> Any:
    """A TracerProvider exporting to the OTLP/gRPC collector at `endpoint` in batches (the
    server's and the router's, so both honour `--otlp-traces-endpoint` the same way)."""
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise ImportError(
            "--otlp-traces-endpoint needs OpenTelemetry: pip install 'inferd[otel]'"
        ) from e
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider
