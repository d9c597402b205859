"""Forwarding one request to the replica the policy chose, with failover.

A try that fails before anything reached the client (connect error, the replica dying before its
answer is complete for a non-streamed request, 429/502/503/504) moves to the next-best replica,
with the same `X-Request-Id`, up to `max_retries` times; the last answer is passed through when
every try fails. A connect error, 502, 504, or a 503 saying `draining`/`engine_dead`/`not_ready`
also takes the replica out of rotation at once (passive health check). A 500 is the request's own
failure and passes through without a retry (another replica would likely fail it the same way).

Streams (`text/event-stream`) pass through event by event as they arrive (the one carrying
`timings` gets `route` added: router/answer.py), never buffered whole; a stream
the replica breaks ends with an SSE error event and `[DONE]`, never a hang. A client that goes
away (while the replica works, or mid-stream) closes the upstream request, so the replica aborts
the generation.

An answer's `usage` (the replica's own cached-token count for the prompt) corrects the prefix
index: blocks the index claimed and the replica no longer held leave it (Cluster.reported).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, replace
from typing import TypeVar

import httpx
import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from inferd.gateway.errors import APIError
from inferd.router.answer import SSEEvents, Usage, read_answer
from inferd.router.cluster import Cluster, NoReplicaError, Routed
from inferd.router.load import Ticket
from inferd.router.metrics import RouterMetrics
from inferd.router.tracing import NO_SPAN, TRACE_HEADERS, RouteSpan

logger = logging.getLogger("inferd.router")

# Not forwarded either way: hop-by-hop, recomputed, or (accept-encoding) kept identity so a
# non-streamed body can be read and extended.
_DROP_REQUEST = {
    "host",
    "content-length",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "upgrade",
    "accept-encoding",
}
_DROP_RESPONSE = {"content-length", "connection", "keep-alive", "transfer-encoding", "date"}
_RETRY_STATUS = {429, 502, 503, 504}
_EJECT_503 = {"draining", "engine_dead", "not_ready"}
_T = TypeVar("_T")
REPLICA_HEADER = "x-inferd-replica"
CACHED_HEADER = "x-inferd-route-cached-tokens"


@dataclass(frozen=True)
class Forward:
    """One client request, read and decided on: what each try sends."""

    method: str
    path: str  # with the query string
    headers: list[tuple[str, str]]
    body: bytes
    token_ids: list[int]
    route_s: float
    # The router's OTel span of this request (router/tracing.py); NO_SPAN with tracing off.
    span: RouteSpan = NO_SPAN
    # The LoRA adapter its prompt runs under (a retry hashes it the same); None: the base model.
    lora_name: str | None = None
    # An image request's latent pixel-steps (a retry is routed as an image request again).
    image_cost: int = 0

    @classmethod
    def of(
        cls,
        request: Request,
        body: bytes,
        token_ids: list[int],
        route_s: float,
        lora_name: str | None = None,
        image_cost: int = 0,
    ) -> Forward:
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST]
        if "x-request-id" not in request.headers:
            headers.append(("x-request-id", uuid.uuid4().hex))  # retries carry the same id
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return cls(
            request.method,
            path,
            headers,
            body,
            token_ids,
            route_s,
            lora_name=lora_name,
            image_cost=image_cost,
        )

    @property
    def request_id(self) -> str:
        return next(v for k, v in self.headers if k.lower() == "x-request-id")

    def traced(self, span: RouteSpan) -> Forward:
        """Every try carries `span` as the replica's parent, in place of the client's own trace
        context (the router's span is already the client's child)."""
        kept = [(k, v) for k, v in self.headers if k.lower() not in TRACE_HEADERS]
        return replace(self, headers=kept + span.headers(), span=span)


class Proxy:
    def __init__(self, cluster: Cluster, client: httpx.AsyncClient, metrics: RouterMetrics):
        self.cluster = cluster
        self.client = client
        self.metrics = metrics

    async def forward(self, request: Request, fwd: Forward, routed: Routed | None) -> Response:
        """The answer of the first try that reaches the client (a stream ends the span when it
        ends; anything else ends it here)."""
        response: Response | None = None
        try:
            response = await self._forward(request, fwd, routed)
            return response
        finally:
            if not isinstance(response, StreamingResponse):
                # None: the 503 for want of a replica is on its way up as an APIError.
                fwd.span.end(response.status_code if response is not None else 503)

    async def _forward(self, request: Request, fwd: Forward, routed: Routed | None) -> Response:
        tried: list[str] = []
        last: Response | None = None
        retries = self.cluster.config.max_retries
        for attempt in range(retries + 1):
            try:
                routed = routed or self._route(fwd, tried)
            except NoReplicaError:
                break
            url = routed.decision.replica
            if not tried:
                fwd.span.decided(routed, fwd.route_s)
            tried.append(url)
            answer = await self._try(request, fwd, routed, url, final=attempt == retries)
            if isinstance(answer, Response):
                return answer
            last, routed = answer.response, None
            self.metrics.retries.labels(answer.reason).inc()
        if last is not None:
            return last
        self.metrics.no_replica.inc()
        seconds = str(self.cluster.config.retry_after_s)
        raise APIError(
            503,
            "no replica is ready",
            type="service_unavailable",
            code="no_replica",
            reason="no_replica",
            headers={"Retry-After": seconds},
        )

    def _route(self, fwd: Forward, tried: list[str]) -> Routed:
        if fwd.image_cost:
            return self.cluster.route_image(fwd.image_cost, tried)
        return self.cluster.route(fwd.token_ids, tried, fwd.lora_name)

    async def _try(
        self, request: Request, fwd: Forward, routed: Routed, url: str, final: bool
    ) -> Response | _Failed:
        ticket = self.cluster.dispatch(url, routed)
        fwd.span.tried(url, routed.prompt_tokens - ticket.prefill_tokens)
        req = self.client.build_request(
            fwd.method, url + fwd.path, headers=fwd.headers, content=fwd.body
        )
        try:
            upstream = await _unless_gone(request, self.client.send(req, stream=True))
        except httpx.TransportError as e:
            ticket.finish()
            self._eject(url, "connect_error", repr(e))
            return _Failed("connect_error")
        if upstream is None:  # the client left while the replica worked: the request is dropped
            ticket.finish()
            return Response(status_code=499)
        if upstream.status_code in _RETRY_STATUS and not final:
            return await self._refused(upstream, ticket, url)
        ticket.first_byte()
        self.metrics.count(url, routed)
        headers = _response_headers(upstream, url, ticket, routed)
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            stream = self._stream(upstream, ticket, routed, fwd)
            return StreamingResponse(stream, upstream.status_code, headers)
        try:
            body = await _unless_gone(request, upstream.aread())
        except httpx.HTTPError as e:
            self._eject(url, "broken_response", repr(e))
            return _Failed("broken_response")
        finally:
            ticket.finish()
            await upstream.aclose()
        if body is None:  # the client left; nobody is listening any more
            return Response(status_code=499)
        body, usage = read_answer(body, fwd.route_s)
        self._reported(ticket, routed, usage)
        return Response(body, upstream.status_code, headers)

    async def _refused(self, upstream: httpx.Response, ticket: Ticket, url: str) -> _Failed:
        try:
            body = await upstream.aread()
        except httpx.HTTPError:
            body = b""
        finally:
            ticket.finish()
            await upstream.aclose()
        code = _error_code(body) or f"status_{upstream.status_code}"
        if upstream.status_code in (502, 504) or code in _EJECT_503:
            self._eject(url, code)
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_RESPONSE}
        return _Failed(code, Response(body, upstream.status_code, headers))

    async def _stream(
        self, upstream: httpx.Response, ticket: Ticket, routed: Routed, fwd: Forward
    ) -> AsyncIterator[bytes]:
        events = SSEEvents(fwd.route_s)
        url = ticket.replica
        try:
            async for chunk in upstream.aiter_raw():
                if out := events.feed(chunk):
                    yield out
            if events.pending:
                yield events.pending
            self._reported(ticket, routed, events.usage)
        except httpx.HTTPError as e:
            self._eject(url, "broken_stream", repr(e))
            message = f"replica {url} failed mid-stream"
            error = {
                "error": {"message": message, "type": "server_error", "code": "replica_failed"}
            }
            yield b"\n\ndata: " + orjson.dumps(error) + b"\n\ndata: [DONE]\n\n"
        finally:
            ticket.finish()
            fwd.span.end(upstream.status_code)
            await upstream.aclose()

    def _eject(self, url: str, reason: str, detail: str = "") -> None:
        if self.cluster.failed(url, reason):
            self.metrics.ejections.labels(url, reason).inc()
            logger.warning("replica %s out of rotation: %s %s", url, reason, detail)

    def _reported(self, ticket: Ticket, routed: Routed, usage: Usage | None) -> None:
        """The replica's own cached-token count corrects the prefix index (Cluster.reported)."""
        if usage is None or not routed.prompt_tokens:
            return
        dropped = self.cluster.reported(ticket, routed, usage.prompt_tokens, usage.cached_tokens)
        if dropped:
            self.metrics.stale_blocks.labels(ticket.replica).inc(dropped)


@dataclass(frozen=True)
class _Failed:
    """A try that reached no client: why, and the replica's answer to pass on if it was the last."""

    reason: str
    response: Response | None = None


def _response_headers(
    upstream: httpx.Response, url: str, ticket: Ticket, routed: Routed
) -> dict[str, str]:
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_RESPONSE}
    headers[REPLICA_HEADER] = url
    cached = routed.prompt_tokens - ticket.prefill_tokens if routed.prompt_tokens else 0
    headers[CACHED_HEADER] = str(cached)
    return headers


async def _unless_gone(request: Request, work: Awaitable[_T]) -> _T | None:
    """`work`'s result, or None when the client disconnects first: `work` is then cancelled,
    which closes the upstream connection so the replica aborts the request."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await task
        return None
    return task.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (its body was already read, so only that can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _error_code(body: bytes) -> str | None:
    """`code` of OpenAI's error body (`{"error": {"code": ...}}`), if it is one."""
    with contextlib.suppress(orjson.JSONDecodeError):
        err = orjson.loads(body).get("error") if body.startswith(b"{") else None
        if isinstance(err, dict) and isinstance(err.get("code"), str):
            return str(err["code"])
    return None
