"""Liveness and readiness, in inferd's and KServe's (Open Inference Protocol v2) shapes, and
/metrics.

live: the process serves HTTP. ready: the model is loaded, the server is not draining, and the
engine process is alive; otherwise 503, so a load balancer stops sending traffic.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import PlainTextResponse, Response

from inferd.gateway.contract import Status, V2Live, V2Ready
from inferd.gateway.responses import json_response
from inferd.gateway.state import GatewayState, gateway
from inferd.telemetry.metrics import CONTENT_TYPE

router = APIRouter()


def _why_not_ready(state: GatewayState) -> str:
    if state.draining:
        return "draining"
    if state.llm is None:
        return "loading"
    if state.llm.dead:
        return "engine_dead"
    return "not_ready"


_NOT_READY: dict[int | str, dict[str, object]] = {
    503: {"model": Status, "description": "Loading, draining, or the engine died"}
}
_V2_NOT_READY: dict[int | str, dict[str, object]] = {
    503: {"model": V2Ready, "description": "Not ready"}
}


@router.get("/health/live", response_model=Status)
async def live() -> Response:
    return json_response({"status": "live"})


@router.get("/health/ready", response_model=Status, responses=_NOT_READY)
@router.get("/health", response_model=Status, responses=_NOT_READY)
async def ready(request: Request) -> Response:
    state = gateway(request)
    if state.ready:
        return json_response({"status": "ready"})
    return json_response({"status": _why_not_ready(state)}, 503)


@router.get("/v2/health/live", response_model=V2Live)
async def v2_live() -> Response:
    return json_response({"live": True})


@router.get("/v2/health/ready", response_model=V2Ready, responses=_V2_NOT_READY)
async def v2_ready(request: Request) -> Response:
    ok = gateway(request).ready
    return json_response({"ready": ok}, 200 if ok else 503)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    return Response(gateway(request).metrics.render(), media_type=CONTENT_TYPE)
