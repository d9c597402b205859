"""The gateway's response types: plain JSON, and responses that run a callback once they were
sent, or failed to be, however they ended.

Every lane uses the finalizing ones to release what a request held (in-flight counts, engine
streams, access-log fields) only after the last byte left, never before (`run_once` makes that
release idempotent), and `Peeked` to hold an engine's stream whose first item was awaited before
any response started (so admission errors get their own status).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import suppress
from typing import Any, Generic, TypeVar

import orjson
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class Peeked(Generic[T]):
    """An engine stream with its first item already taken. `aclose` always reaches the stream
    (closing it aborts the request in the engine), even when iteration never started (a plain
    generator would skip its `finally`)."""

    def __init__(self, first: T, rest: AsyncIterator[T]) -> None:
        self._first: T | None = first
        self._rest = rest

    def __aiter__(self) -> Peeked[T]:
        return self

    async def __anext__(self) -> T:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await anext(self._rest)

    async def aclose(self) -> None:
        self._first = None
        await aclose_quietly(self._rest)


async def aclose_quietly(stream: AsyncIterator[Any]) -> None:
    """Closes `stream` if it can be closed; an error while closing is not the response's."""
    close = getattr(stream, "aclose", None)
    if close is not None:
        with suppress(Exception):
            await close()


def run_once(fn: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    """`fn`, of which only the first call runs: a route and its response may both finalize."""
    ran: list[bool] = []

    async def once() -> None:
        if not ran:
            ran.append(True)
            await fn()

    return once


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """`obj` encoded by orjson, with `status`: every JSON body of the gateway's own routes."""
    return Response(orjson.dumps(obj), status, headers, media_type="application/json")


class _Finalizing:
    """Runs `on_done` once the response was sent, or failed to be, however it ended."""

    on_done: Callable[[], Awaitable[None]]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)  # type: ignore[misc]
        finally:
            await self.on_done()


class FinalizingResponse(_Finalizing, Response):
    def __init__(
        self,
        content: bytes,
        on_done: Callable[[], Awaitable[None]],
        media_type: str,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(content, headers=headers, media_type=media_type)
        self.on_done = on_done


class FinalizingStreamingResponse(_Finalizing, StreamingResponse):
    """A stream ends done, client gone (the iterator may never have started, so `on_done` must
    close the engine streams), or in error: `on_done` runs in every case."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        on_done: Callable[[], Awaitable[None]],
        media_type: str,
    ) -> None:
        super().__init__(content, media_type=media_type, headers={"Cache-Control": "no-cache"})
        self.on_done = on_done
