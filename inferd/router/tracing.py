"""The router's OpenTelemetry span per forwarded request, and the W3C `traceparent` that makes
the replica's own trace its child.

One span, `inferd.route` (the stage vocabulary's `route`), from the request's arrival at the
router to the end of the replica's answer (the last stream chunk): it covers the decision, every
try, and the replica's work, so the replica's `inferd.request` span (whose parent it is, through
the `traceparent` header each try carries) nests inside it. A client's own `traceparent` makes the
router's span its child in turn. Attributes (`inferd.route.*`): the policy, the replica that
answered, the policy's outcome, the cached tokens the index expected there, the decision seconds,
the retries; plus the request id, prompt tokens and the HTTP status.

Off unless `--otlp-traces-endpoint` is set: every request then gets `NO_SPAN`, whose methods do
nothing, and the client's own `traceparent` passes to the replica untouched.

    tracer = RouteTracer.from_endpoint("http://collector:4317")   # None: tracing off
    span = tracer.start(request_id, client_traceparent, start_s)
    span.decided(routed, route_s); span.tried(url, cached); ...; span.end(200)
"""

from __future__ import annotations

import time
from typing import Any

from inferd.router.cluster import Routed
from inferd.telemetry.stages import Stage
from inferd.telemetry.tracing import otlp_provider, remote_parent

SPAN_NAME = f"inferd.{Stage.ROUTE}"
# Headers of trace context the router replaces with its own span's when tracing is on.
TRACE_HEADERS = ("traceparent", "tracestate")


class RouteSpan:
    """One request's span; every method is safe to call on a span that already ended (a stream
    the client abandoned may end it late or twice)."""

    def __init__(self, span: Any = None, policy: str = "") -> None:
        self._span = span
        self._policy = policy
        self._tries = 0

    def headers(self) -> list[tuple[str, str]]:
        """The trace context a try carries to the replica: this span as the parent."""
        if self._span is None:
            return []
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        ctx = trace.set_span_in_context(self._span)
        TraceContextTextMapPropagator().inject(carrier, context=ctx)
        return list(carrier.items())

    def decided(self, routed: Routed, route_s: float) -> None:
        if self._span is None:
            return
        self._span.set_attributes(
            {
                "inferd.route.policy": self._policy,
                "inferd.route.outcome": routed.decision.outcome
                if routed.prompt_tokens
                else "passthrough",
                "inferd.route.decision_seconds": round(route_s, 6),
                "inferd.prompt_tokens": routed.prompt_tokens,
            }
        )

    def tried(self, replica: str, cached_tokens: int) -> None:
        """A try goes to `replica`, whose index expected `cached_tokens` of the prompt: the last
        try's values are the ones the span keeps (the replica that answered)."""
        self._tries += 1
        if self._span is None:
            return
        self._span.set_attributes(
            {
                "inferd.route.replica": replica,
                "inferd.route.cached_tokens": cached_tokens,
                "inferd.route.retries": self._tries - 1,
            }
        )

    def end(self, status: int) -> None:
        span, self._span = self._span, None
        if span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
        span.end()


NO_SPAN = RouteSpan()


class RouteTracer:
    """Starts the router's spans on an OTel tracer (the SDK's, or a test's)."""

    def __init__(self, tracer: Any, policy: str, provider: Any = None) -> None:
        self._tracer = tracer
        self._policy = policy
        self._provider = provider
        # CLOCK_MONOTONIC -> Unix epoch nanoseconds, fixed once (spans want wall-clock times).
        self._offset_ns = time.time_ns() - time.monotonic_ns()

    @classmethod
    def from_endpoint(cls, endpoint: str | None, policy: str) -> RouteTracer | None:
        """None when `endpoint` is unset; ImportError with the fix when the `otel` extra is not
        installed (the server's rule)."""
        if not endpoint:
            return None
        provider = otlp_provider(endpoint, "inferd-router")
        return cls(provider.get_tracer("inferd.router"), policy, provider)

    def start(self, request_id: str, traceparent: str | None, start_s: float) -> RouteSpan:
        """A span from `start_s` (time.monotonic()), child of the client's `traceparent` if any."""
        span = self._tracer.start_span(
            SPAN_NAME,
            context=remote_parent(traceparent),
            start_time=int(start_s * 1e9) + self._offset_ns,
            attributes={"inferd.request_id": request_id},
        )
        return RouteSpan(span, self._policy)

    def shutdown(self) -> None:
        """Flushes what the batch processor still holds."""
        if self._provider is not None:
            self._provider.shutdown()
