"""The HTTP app: `create_app(llm, server)` wires routes, middleware, errors and telemetry.

    app = create_app(llm, ServerConfig())        # llm may be None while the model loads
    set_engine(app, llm)                         # ...and is attached once it has
    set_image_engines(app, {"tiny-sd": engine})  # the image models it serves, by name
    uvicorn.run(app, port=8000)

Routes: openai/routes.py (/v1/models, completions, chat), openai/embeddings.py (/v1/embeddings,
served by the model repository), openai/images.py (/v1/images/generations, the image models),
openai/websocket.py (/v1/*/ws), openai/image_websocket.py (/v1/images/generations/ws),
kserve/http.py (the Open Inference Protocol: /v2, /v2/models/..., /v2/repository/...; image
models too: kserve/image_models.py), openai/adapters.py (LoRA
adapters' names, /v1/load_lora_adapter and /v1/unload_lora_adapter), health.py (/health/*,
/v2/health/*, /metrics), kv_cache.py (/v1/kv_cache/blocks, the block digest a router reads).
Errors are OpenAI's JSON on /v1 and KServe's `{"error": ...}` on /v2 (errors.py). Responses
that release a request's resources after sending: responses.py. OpenAPI at /openapi.json.
"""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from inferd.config import ServerConfig
from inferd.diffusion.request import ImageEngine
from inferd.gateway import dashboard, health, kv_cache
from inferd.gateway.auth import Guard
from inferd.gateway.contract import openapi_document
from inferd.gateway.errors import install_error_handlers
from inferd.gateway.kserve import http as kserve_http
from inferd.gateway.middleware import GatewayMiddleware
from inferd.gateway.openai import adapters, embeddings, image_websocket, images, websocket
from inferd.gateway.openai import routes as openai
from inferd.gateway.state import EngineClient, GatewayState, gateway_state
from inferd.telemetry.image_metrics import ImageMetrics
from inferd.telemetry.metrics import ServerMetrics
from inferd.telemetry.model_metrics import ModelMetrics
from inferd.telemetry.tracing import RequestTracer, make_tracer


class InferdApp(FastAPI):
    """FastAPI with KServe v2 inference served ahead of its stack (kserve/http.py's
    `infer_front`): every other request takes the app's own middleware and router."""

    infer_front: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        front = self.infer_front
        if front is not None and (params := kserve_http.infer_path_params(scope)) is not None:
            scope["app"] = self
            scope["path_params"] = params
            await front(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


def create_app(
    llm: EngineClient | None,
    server: ServerConfig,
    *,
    tracer: RequestTracer | None = None,
    lora_updates: bool = False,
) -> InferdApp:
    """`tracer`: None builds one from `server.otlp_traces_endpoint` (None when that is unset).
    `lora_updates`: serve /v1/load_lora_adapter and /v1/unload_lora_adapter (the environment's
    allow_runtime_lora_updating)."""
    app = InferdApp(
        title="inferd",
        summary="OpenAI-compatible LLM inference server",
        version="0.1.0",
        docs_url="/docs",
        redoc_url=None,
    )
    metrics = ServerMetrics()
    image_metrics = ImageMetrics(metrics.registry)
    state = GatewayState(
        server=server,
        metrics=metrics,
        model_metrics=ModelMetrics(metrics.registry),
        image_metrics=image_metrics,
        llm=llm,
    )
    state.metrics.watch_engine(state.engine_gauges)
    state.metrics.watch_models(state.model_inflight)
    image_metrics.watch_engines(state.image_stats)
    state.tracer = tracer if tracer is not None else make_tracer(server.otlp_traces_endpoint)
    app.state.gateway = state
    app.include_router(openai.router)
    app.include_router(websocket.router)
    app.include_router(health.router)
    app.include_router(embeddings.router)
    app.include_router(images.router)
    app.include_router(image_websocket.router)
    app.include_router(kserve_http.router)
    app.include_router(kv_cache.router)
    if lora_updates:
        app.include_router(adapters.router)
    if server.dashboard:
        dashboard.install(app, state)
    install_error_handlers(app, on_reject=state.metrics.reject)
    app.openapi = lambda: openapi_document(app)  # type: ignore[method-assign]
    guard = Guard.from_config(server, metrics)  # built here: a bad key file fails at start
    app.add_middleware(
        GatewayMiddleware, server=server, on_reject=state.metrics.reject, guard=guard
    )

    def gateway_middleware(inner: ASGIApp) -> ASGIApp:  # the same guard: one key, one limit
        return GatewayMiddleware(inner, server, state.metrics.reject, guard)

    app.infer_front = kserve_http.infer_front(app, gateway_middleware)
    state.guard = guard
    return app


def set_engine(app: FastAPI, llm: EngineClient) -> None:
    gateway_state(app).llm = llm


def set_image_engines(app: FastAPI, engines: Mapping[str, ImageEngine]) -> None:
    """Serves these image models, by name (OpenAI images, /v1/models, KServe v2); readiness
    then also waits for each engine's `ready()`."""
    gateway_state(app).images = dict(engines)
