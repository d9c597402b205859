"""HTTP connections that must deliver their request in time (`--read-timeout`).

uvicorn bounds the idle time between keep-alive requests (`timeout_keep_alive`) but not the
time a request takes to arrive: a client that sends one header byte a second (slowloris), or a
body that trickles in, holds its connection, its parser state and (once the headers are in) an
ASGI task for as long as it likes. This protocol arms one timer when a connection opens and
when each request on it begins, and disarms it when that request's last body byte has arrived;
if it fires first, the connection is aborted, and a request whose body had begun never reaches
the app (the gateway middleware sees the disconnect while it reads the body). A WebSocket
upgrade disarms it: the WebSocket protocol takes the connection.

    config = uvicorn.Config(app, http=read_timeout_protocol(30.0))

and where a started server listens (`listening_port`: the port the OS chose for `--port 0`).
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger("inferd.gateway")


class ReadTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on each request's arrival."""

    read_timeout_s = 60.0  # set per server by `read_timeout_protocol`
    _read_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        if self._read_timer is None:
            self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if not self.transport.is_closing():
            logger.info("closing %s: no whole request in %.1f s", self.client, self.read_timeout_s)
            # abort, not close: close would wait for the slow client to acknowledge (a TLS
            # close_notify, a flush), the very thing it may never do. connection_lost follows
            # at once and tells a running app `http.disconnect`.
            self.transport.abort()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def handle_websocket_upgrade(self) -> None:
        self._disarm()
        super().handle_websocket_upgrade()


def read_timeout_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    """The protocol class for uvicorn.Config(http=...), with `timeout_s` per request."""
    return type("ReadTimeoutProtocol", (ReadTimeoutProtocol,), {"read_timeout_s": timeout_s})


def listening_port(server: uvicorn.Server, configured: int) -> int:
    """The TCP port `server` listens on once started: `configured`, or the one the OS chose when
    that was 0."""
    for listener in server.servers:
        for sock in listener.sockets:
            return int(sock.getsockname()[1])
    return configured
