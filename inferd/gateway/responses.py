"""The gateway's response types: plain JSON, and responses that run a callback once they were
sent, or failed to be, however they ended.

Both lanes use the finalizing ones to release what a request held (in-flight counts, engine
streams, access-log fields) only after the last byte left, never before.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send


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
        self, content: bytes, on_done: Callable[[], Awaitable[None]], media_type: str
    ) -> None:
        super().__init__(content, media_type=media_type)
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
