"""Liveness and readiness, in inferd's and KServe's (Open Inference Protocol v2) shapes, and
/metrics.

live: the process serves HTTP. ready: the model is loaded, the server is not draining, and the
engine process is alive; otherwise 503, so a load balancer stops sending traffic.
"""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from inferd.gateway.state import GatewayState
from inferd.telemetry.metrics import CONTENT_TYPE

router = APIRouter()


def _state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


def _json(obj: object, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status, media_type="application/json")


def _why_not_ready(state: GatewayState) -> str:
    if state.draining:
        return "draining"
    if state.llm is None:
        return "loading"
    if state.llm.dead:
        return "engine_dead"
    return "not_ready"


@router.get("/health/live")
async def live() -> Response:
    return _json({"status": "live"})


@router.get("/health/ready")
@router.get("/health")
async def ready(request: Request) -> Response:
    state = _state(request)
    if state.ready:
        return _json({"status": "ready"})
    return _json({"status": _why_not_ready(state)}, 503)


@router.get("/v2/health/live")
async def v2_live() -> Response:
    return _json({"live": True})


@router.get("/v2/health/ready")
async def v2_ready(request: Request) -> Response:
    ok = _state(request).ready
    return _json({"ready": ok}, 200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)
