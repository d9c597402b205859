"""The pure-ASGI wrapper every HTTP request and WebSocket goes through.

In order: a request id (the client's `X-Request-Id` if it sent a sane one, else a new one;
returned on the response), the arrival time (the `receive` stage starts here), API-key auth,
scope and per-key limits on every inference route (all but health, /metrics and docs; see
auth.py: 401, 403 on admin routes, 429 with Retry-After, x-ratelimit-* on every response), the
body size limit (413 before anything parses it), and one JSON access-log line when the response
is done. Refusals here use
the error body of the path's protocol (KServe's on /v2/*, OpenAI's elsewhere). Pure ASGI rather
than BaseHTTPMiddleware, so streamed responses pass through untouched and disconnects still
reach the app.
"""

from __future__ import annotations

import random
import re
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferd.config import ServerConfig
from inferd.gateway.auth import Admission, Guard, Refusal
from inferd.gateway.errors import APIError, is_kserve_path
from inferd.telemetry.access_log import AccessRecord, log_access
from inferd.telemetry.request_log import RequestContext, current_request

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
# The dashboard's page and assets hold no data (its data is under /v1, behind the key).
_OPEN_PATHS = (
    "/health",
    "/v2/health",
    "/metrics",
    "/openapi.json",
    "/docs",
    "/redoc",
    "/dashboard",
)
# Routes that change server state: they need a key with the admin scope.
_ADMIN_RE = re.compile(
    r"^(/v2/repository/models/[^/]+/(load|unload)|/v1/(load|unload)_lora_adapter)$"
)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def _request_id(scope: Scope) -> str:
    given = _header(scope, b"x-request-id")
    if given is not None and _REQUEST_ID_RE.match(given):
        return given
    # 128 random bits as 32 hex digits, as uuid4().hex gave, at a tenth of its cost (no
    # syscall, no UUID object): an id needs to be unique, not unpredictable.
    return f"{random.getrandbits(128):032x}"


def _needs_auth(path: str) -> bool:
    return not path.startswith(_OPEN_PATHS)


def _refused(refusal: Refusal) -> APIError:
    return APIError(
        refusal.status,
        refusal.message,
        type=refusal.error_type,
        code=refusal.code,
        reason=refusal.reason,
        headers=dict(refusal.headers),
    )


def _tokens_used(scope: Scope) -> int:
    """Prompt + completion tokens the route reported (completions, chat, WebSocket)."""
    extra = scope["state"].get("access_extra", {})
    return int(extra.get("prompt_tokens", 0) or 0) + int(extra.get("completion_tokens", 0) or 0)


class GatewayMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        server: ServerConfig,
        on_reject: Any = None,
        guard: Guard | None = None,
    ) -> None:
        """`guard`: the API keys and their limits; None builds one from `server` (None when
        it names no keys: no authentication)."""
        self.app = app
        self.server = server
        self.on_reject = on_reject
        self.guard = guard if guard is not None else Guard.from_config(server, None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["arrival"] = time.monotonic()
        state["request_id"] = _request_id(scope)
        # For reports made deep in a lane without the request at hand (telemetry/request_log.py).
        current_request.set(RequestContext(state["request_id"], state["arrival"]))
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        await self._http(scope, receive, send)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One WebSocket connection is one admitted request of its key (it holds one
        concurrency slot while open); the tokens of its requests are charged at the end."""
        try:
            admission = self._admit(scope)
        except Refusal as refusal:
            if self.on_reject is not None:
                self.on_reject(refusal.reason)
            await receive()  # websocket.connect
            code = 1013 if refusal.status == 429 else 1008  # 1013: try again later
            await send({"type": "websocket.close", "code": code, "reason": refusal.message})
            return
        try:
            await self.app(scope, receive, send)
        finally:
            if admission is not None:
                admission.done(_tokens_used(scope))

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        record = AccessRecord(
            request_id=scope["state"]["request_id"],
            method=scope.get("method", ""),
            path=scope.get("path", ""),
            client=_client(scope),
            arrival=scope["state"]["arrival"],
        )
        admission: Admission | None = None
        try:
            admission, error = self._precheck(scope)
            send = self._wrap_send(send, record, admission)
            if error is None:
                try:
                    receive, error = await self._limit_body(scope, receive)
                except _ClientGone:
                    return  # logged with status 0: no response was started
            if error is not None:
                if self.on_reject is not None:
                    self.on_reject(error.reason)
                kserve = is_kserve_path(scope.get("path", ""))
                await error.response(kserve)(scope, receive, send)
                return
            await self.app(scope, receive, send)
        finally:
            if admission is not None:
                admission.done(_tokens_used(scope))
            if self.server.access_log:
                record.extra = scope["state"].get("access_extra", {})
                log_access(record)

    def _wrap_send(self, send: Send, record: AccessRecord, admission: Admission | None) -> Send:
        request_id = record.request_id.encode()

        async def wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id))
                if admission is not None:
                    headers += [(k.encode(), v.encode()) for k, v in admission.headers()]
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body":
                record.bytes_out += len(message.get("body", b""))
            await send(message)

        return wrapped

    def _admit(self, scope: Scope) -> Admission | None:
        """The request's admission under its key; None when no key is needed. Raises Refusal."""
        path = scope.get("path", "")
        if self.guard is None or not _needs_auth(path):
            return None
        auth = _header(scope, b"authorization")
        return self.guard.admit(auth, admin=bool(_ADMIN_RE.match(path)))

    def _precheck(self, scope: Scope) -> tuple[Admission | None, APIError | None]:
        try:
            admission = self._admit(scope)
        except Refusal as refusal:
            return None, _refused(refusal)
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.server.max_body_bytes:
            return admission, _too_large(self.server.max_body_bytes)
        return admission, None

    async def _limit_body(self, scope: Scope, receive: Receive) -> tuple[Receive, APIError | None]:
        """Reads the whole body (bounded) and replays it; later receives (disconnect) pass
        through. A chunked upload without Content-Length is bounded here too. A client that
        leaves before its body is complete (or is cut off by --read-timeout) raises
        _ClientGone: the app never sees a request nobody waits for."""
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return receive, None
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone()
            body = message.get("body", b"")
            size += len(body)
            if size > self.server.max_body_bytes:
                return receive, _too_large(self.server.max_body_bytes)
            chunks.append(body)
            more = message.get("more_body", False)
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        return _replay([whole], receive), None


class _ClientGone(Exception):
    """The client disconnected before its request body was complete."""


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than {limit} bytes",
        code="request_too_large",
        reason="too_large",
    )


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else ""
