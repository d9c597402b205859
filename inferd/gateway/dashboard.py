"""The live dashboard: its page, a live overview stream, and every recent request's timeline.

    GET /dashboard                       the page (static files from the package, no CDN)
    GET /dashboard/static/{file}         its scripts and style sheet
    GET /v1/dashboard/overview           one overview snapshot (telemetry/overview.py)
    GET /v1/dashboard/events             the same, as Server-Sent Events, every `interval` s
    GET /v1/requests?model=&status=&lane=&slowest=1&limit=   recent requests, newest first
    GET /v1/requests/{request_id}        one request's waterfall (the response's X-Request-Id)

The page shell and its assets hold no data and are open (a browser cannot send a bearer key on
a page load); everything with data is under /v1, behind the API key when keys are set (the
page asks for one on a 401 and sends it with each fetch). `--disable-dashboard` leaves all of
these routes out (404) and records nothing.

Cost: the request path appends one record to the RequestLog when a request finishes (the
telemetry hooks); an overview is computed only for an open page, once per tick.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncIterator, Mapping
from importlib import resources

import orjson
from fastapi import APIRouter, FastAPI, Request
from starlette.responses import HTMLResponse, Response, StreamingResponse

from inferd.gateway.errors import APIError
from inferd.gateway.responses import json_response
from inferd.gateway.state import GatewayState, gateway
from inferd.telemetry.overview import BatchTotals, HistogramTotals, ImageCounters, overview
from inferd.telemetry.request_log import RequestLog

router = APIRouter(include_in_schema=False)

_ASSETS = {"app.js": "text/javascript", "common.js": "text/javascript", "style.css": "text/css"}
_WINDOW_S = 60.0
_MIN_INTERVAL_S = 0.25


def install(app: FastAPI, state: GatewayState, log: RequestLog | None = None) -> RequestLog:
    """Adds the routes and starts recording finished requests of every lane into `log`."""
    log = log if log is not None else RequestLog(llm_model=lambda: state.model_name)
    app.state.request_log = log
    state.metrics.request_log = log
    state.model_metrics.request_log = log
    if state.image_metrics is not None:
        state.image_metrics.request_log = log
    app.include_router(page_routes("index.html", _ASSETS))
    app.include_router(router)
    return log


def _log(request: Request) -> RequestLog:
    log: RequestLog = request.app.state.request_log
    return log


def page_routes(page: str, assets: Mapping[str, str]) -> APIRouter:
    """`GET /dashboard` (the HTML file `page`) and `GET /dashboard/static/{name}` for `assets`
    (file name -> media type). The server's page and the router's are both served from this
    package's static/dashboard folder, and share its style sheet and common.js."""
    routes = APIRouter(include_in_schema=False)

    @routes.get("/dashboard")
    async def html() -> Response:
        return HTMLResponse(_asset(page), headers={"Cache-Control": "no-cache"})

    @routes.get("/dashboard/static/{name}")
    async def asset(name: str) -> Response:
        media_type = assets.get(name)
        if media_type is None:
            raise APIError(404, f"no dashboard file {name!r}", code="not_found", reason="not_found")
        return Response(_asset(name), media_type=media_type, headers={"Cache-Control": "no-cache"})

    return routes


def _asset(name: str) -> bytes:
    return resources.files("inferd.gateway").joinpath("static", "dashboard", name).read_bytes()


class _Overview:
    """Overview snapshots for one reader; keeps the batch histograms' totals of the last
    window so the classic models' batch size and padding are means over the window."""

    def __init__(self, state: GatewayState, log: RequestLog, window_s: float) -> None:
        self.state, self.log, self.window_s = state, log, window_s
        self.batches: deque[BatchTotals] = deque()

    def snapshot(self) -> dict[str, object]:
        mm = self.state.model_metrics
        engine = self.state.engine_gauges()
        now = BatchTotals(
            asyncio.get_running_loop().time(),
            HistogramTotals.read(mm.batch_size),
            HistogramTotals.read(mm.padding),
            0 if engine is None else engine.prefix_cache_queries_tokens_total,
            0 if engine is None else engine.prefix_cache_hits_tokens_total,
            ImageCounters.read(self.state.image_stats().values()),
        )
        while self.batches and now.at - self.batches[0].at > self.window_s:
            self.batches.popleft()
        oldest = self.batches[0] if self.batches else None
        self.batches.append(now)
        doc = overview(
            self.log,
            self.window_s,
            engine,
            (now, oldest),
            self.state.model_name,
            list(self.state.images),
        )
        doc["lanes"] = {
            "llm": self.state.serves_llm,
            "classic": self.state.serves_repository,
            "image": bool(self.state.images),
        }
        return doc


def _window(request: Request) -> float:
    return float_param(request, "window", _WINDOW_S, 1.0, 3600.0)


@router.get("/v1/dashboard/overview")
async def overview_once(request: Request) -> Response:
    return json_response(_Overview(gateway(request), _log(request), _window(request)).snapshot())


@router.get("/v1/dashboard/events")
async def overview_events(request: Request) -> Response:
    """`data: {overview}` every `interval` seconds (default 1) until the client leaves or the
    server drains."""
    state = gateway(request)
    interval = float_param(request, "interval", 1.0, _MIN_INTERVAL_S, 60.0)
    source = _Overview(state, _log(request), _window(request))

    async def events() -> AsyncIterator[bytes]:
        yield b"retry: 2000\n\n"
        while not state.draining and not await request.is_disconnected():
            yield b"data: " + orjson.dumps(source.snapshot()) + b"\n\n"
            await asyncio.sleep(interval)

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


@router.get("/v1/requests")
async def list_requests(request: Request) -> Response:
    q = request.query_params
    rows = _log(request).recent(
        model=q.get("model") or None,
        status=q.get("status") or None,
        lane=q.get("lane") or None,
        slowest=q.get("slowest", "") in ("1", "true", "yes"),
        limit=int(float_param(request, "limit", 100, 1, 1000)),
    )
    return json_response({"object": "list", "data": [r.summary() for r in rows]})


@router.get("/v1/requests/{request_id}")
async def one_request(request: Request, request_id: str) -> Response:
    record = _log(request).get(request_id)
    if record is None:
        raise APIError(
            404,
            f"no finished request {request_id!r} is retained (recent, slowest and failed "
            "requests are kept; older ones roll over)",
            code="not_found",
            reason="not_found",
        )
    return json_response(record.timeline())


def float_param(request: Request, name: str, default: float, lo: float, hi: float) -> float:
    """The query parameter `name` clamped to [lo, hi]; `default` when absent; a 400 when it is
    not a number."""
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isnan(value):  # "nan" parses, and would pass through min/max unclamped
        raise APIError(400, f"'{name}' must be a number", param=name)
    return min(max(value, lo), hi)
