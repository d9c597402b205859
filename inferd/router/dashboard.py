"""The router's dashboard: its page and a live overview of the replicas (router/overview.py).

    GET /dashboard                  the page (router.html; the server dashboard's style sheet)
    GET /dashboard/static/{file}    its script and style sheet, from the inferd.gateway package
    GET /v1/dashboard/overview      one overview snapshot
    GET /v1/dashboard/events        the same, as Server-Sent Events, every `interval` s (default
                                    1), until the client leaves or the router shuts down

The router has no API key of its own (it forwards each client's Authorization header to the
replicas, which check it), so these routes are open like its /metrics; `inferd router
--disable-dashboard` leaves them out (404). A replica row links to that replica's own
/dashboard, where its requests' waterfalls are.

Cost: nothing on the request path; a snapshot reads counters the router keeps anyway, once per
tick of an open page, and keeps at most one copy of them a second for the last hour (the
longest `window`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import orjson
from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response, StreamingResponse

from inferd.gateway.dashboard import float_param, page_routes
from inferd.gateway.responses import json_response
from inferd.router.cluster import Cluster
from inferd.router.metrics import RouterMetrics
from inferd.router.overview import History, Totals, overview

_ASSETS = {"common.js": "text/javascript", "router.js": "text/javascript", "style.css": "text/css"}
_WINDOW_S = 60.0
_MAX_WINDOW_S = 3600.0
_MIN_INTERVAL_S = 0.25


class RouterOverview:
    """Overview snapshots over a window: now, against the Totals `history` kept from the
    window's start (one history for every reader, so every window reaches back before the page
    opened)."""

    def __init__(self, cluster: Cluster, metrics: RouterMetrics) -> None:
        self.cluster, self.metrics = cluster, metrics
        self.history = History(Totals(time.monotonic()), keep_s=_MAX_WINDOW_S)

    def snapshot(self, window_s: float) -> dict[str, object]:
        now = Totals.read(self.metrics, self.cluster, time.monotonic())
        oldest = self.history.before(now.at - window_s)
        self.history.add(now)
        return overview(self.cluster, now, oldest, window_s)


def install(
    app: FastAPI, cluster: Cluster, metrics: RouterMetrics, stopping: Callable[[], bool]
) -> None:
    """Adds the routes; `stopping()` turns true when the router shuts down (streams end)."""
    source = RouterOverview(cluster, metrics)
    routes = APIRouter(include_in_schema=False)

    def window(request: Request) -> float:
        return float_param(request, "window", _WINDOW_S, 1.0, _MAX_WINDOW_S)

    @routes.get("/v1/dashboard/overview")
    async def overview_once(request: Request) -> Response:
        return json_response(source.snapshot(window(request)))

    @routes.get("/v1/dashboard/events")
    async def overview_events(request: Request) -> Response:
        interval = float_param(request, "interval", 1.0, _MIN_INTERVAL_S, 60.0)
        window_s = window(request)

        async def events() -> AsyncIterator[bytes]:
            yield b"retry: 2000\n\n"
            while not stopping() and not await request.is_disconnected():
                yield b"data: " + orjson.dumps(source.snapshot(window_s)) + b"\n\n"
                await asyncio.sleep(interval)

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    app.include_router(page_routes("router.html", _ASSETS))
    app.include_router(routes)
