"""`inferd router`: an HTTP front speaking the replicas' own APIs, routing each request.

    POST /v1/completions, /v1/chat/completions, /v1/embeddings   validated, tokenized, routed by
                                                                  the policy on the prompt (under
                                                                  the LoRA adapter `model` names)
    POST /v1/images/generations                                   routed by its cost: the fewest
                                                                  latent pixel-steps in flight
    any other /v1/*, /v2/* (models, KServe v2 infer by name...)   forwarded as is, routed on load
    /health/live, /health/ready, /health, /v2/health/*            the router's own (ready: some
                                                                  replica is in rotation)
    /metrics                                                      the router's own metrics
    /dashboard, /v1/dashboard/overview, /v1/dashboard/events      the replicas' load and hit
                                                                  rates, live (dashboard.py)

Errors leave in each protocol's own form (the gateway's handlers): a malformed request is
answered here and never forwarded; 503 + Retry-After when no replica is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable, Generator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import uvicorn
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import JSONResponse, Response

from inferd.gateway.connection import listening_port
from inferd.gateway.errors import bad_request, install_error_handlers
from inferd.preprocess.tokenizer import Tokenizer
from inferd.router import dashboard
from inferd.router.cluster import Cluster, Routed
from inferd.router.config import RouterConfig
from inferd.router.health import HealthChecker
from inferd.router.image_cost import IMAGE_PATHS, image_cost
from inferd.router.kv_events import KVEventFeed
from inferd.router.metrics import RouterMetrics
from inferd.router.proxy import Forward, Proxy
from inferd.router.tokenize import (
    TOKENIZED_PATHS,
    load_tokenizer,
    prompt_token_ids,
    requested_model,
    validate,
)
from inferd.router.tracing import RouteTracer

logger = logging.getLogger("inferd.router")


class Router:
    """What the app's routes share."""

    def __init__(
        self,
        config: RouterConfig,
        tokenizer: Tokenizer,
        transport: httpx.AsyncBaseTransport | None = None,
        tracer: RouteTracer | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.cluster = Cluster(config)
        self.metrics = RouterMetrics(self.cluster)
        timeout = httpx.Timeout(config.connect_timeout_s, read=config.read_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport)
        self.health = HealthChecker(self.cluster, self.client, self.metrics)
        self.proxy = Proxy(self.cluster, self.client, self.metrics)
        self.kv_events = KVEventFeed(self.cluster.index, config.kv_event_endpoints(), self.metrics)
        endpoint = config.otlp_traces_endpoint
        self.tracer = tracer or RouteTracer.from_endpoint(endpoint, config.policy)
        # Set on SIGTERM/SIGINT and at shutdown: open dashboard streams end, so they do not hold
        # uvicorn's shutdown (it waits for every response to finish).
        self.stopping = False

    async def routed_request(self, request: Request) -> Response:
        """Validate and tokenize (4xx here), decide, forward."""
        body = await request.body()
        t0 = time.monotonic()
        doc = _json(body)
        valid = validate(request.url.path, doc)
        ids = prompt_token_ids(self.tokenizer, valid)
        lora_name = self.cluster.adapters.lora_name(requested_model(valid))
        routed = self._route(ids, lora_name)
        route_s = time.monotonic() - t0
        self.metrics.decision.observe(route_s)
        fwd = self._traced(request, Forward.of(request, body, ids, route_s, lora_name), t0)
        return await self.proxy.forward(request, fwd, routed)

    async def image_request(self, request: Request) -> Response:
        """Routed by its cost in latent pixel-steps (router/image_cost.py); the replica
        validates it."""
        body = await request.body()
        t0 = time.monotonic()
        doc = _json(body)
        cfg = self.cluster.config
        cost = image_cost(doc, cfg.image_default_steps, cfg.image_default_size)
        routed = self.cluster.route_image(cost) if self.cluster.ready() else None
        route_s = time.monotonic() - t0
        self.metrics.decision.observe(route_s)
        fwd = Forward.of(request, body, [], route_s, image_cost=cost)
        return await self.proxy.forward(request, self._traced(request, fwd, t0), routed)

    async def passthrough(self, request: Request) -> Response:
        t0 = time.monotonic()
        body = await request.body()
        fwd = self._traced(request, Forward.of(request, body, [], 0.0), t0)
        return await self.proxy.forward(request, fwd, None)

    def _traced(self, request: Request, fwd: Forward, start_s: float) -> Forward:
        """`fwd` with its span (started at `start_s`), when tracing is on."""
        if self.tracer is None:
            return fwd
        traceparent = request.headers.get("traceparent")
        return fwd.traced(self.tracer.start(fwd.request_id, traceparent, start_s))

    def _route(self, ids: list[int], lora_name: str | None) -> Routed | None:
        """None when no replica is ready: `forward` answers the 503."""
        return self.cluster.route(ids, lora_name=lora_name) if self.cluster.ready() else None

    async def close(self) -> None:
        self.stopping = True
        await self.kv_events.stop()
        await self.health.stop()
        await self.client.aclose()
        if self.tracer is not None:
            self.tracer.shutdown()  # flushes the spans still batched

    def readiness(self) -> Response:
        ready = len(self.cluster.ready())
        # Both protocols' shapes: OpenAI-side `status`, KServe v2's `ready`.
        status = {
            "status": "ready" if ready else "no_replica",
            "ready": ready > 0,
            "replicas_ready": ready,
        }
        return JSONResponse(status, 200 if ready else 503)


def _json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"malformed JSON: {e}", None, "invalid_json") from e


def create_router_app(
    config: RouterConfig,
    tokenizer: Tokenizer | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    tracer: RouteTracer | None = None,
) -> FastAPI:
    """`tokenizer`, `transport` (to the replicas) and `tracer` are injectable for tests."""
    tok = tokenizer or load_tokenizer(config.model, config.tokenizer, config.revision)
    router = Router(config, tok, transport, tracer)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.health.check_all()  # in rotation before the first request, not an interval on
        router.health.start()
        router.kv_events.start()
        yield
        await router.close()

    app = FastAPI(title="inferd router", lifespan=lifespan, openapi_url=None)
    app.state.router = router
    install_error_handlers(app)

    for path in TOKENIZED_PATHS:
        app.add_api_route(path, router.routed_request, methods=["POST"])
    for path in IMAGE_PATHS:
        app.add_api_route(path, router.image_request, methods=["POST"])

    @app.get("/health/live")
    @app.get("/v2/health/live")
    async def live() -> Response:
        return JSONResponse({"status": "live", "live": True})

    @app.get("/health/ready")
    @app.get("/health")
    @app.get("/v2/health/ready")
    async def ready() -> Response:
        return router.readiness()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def passthrough(request: Request) -> Response:
        return await router.passthrough(request)

    if config.dashboard:  # before the /v1 pass-through, which would take its paths
        dashboard.install(app, router.cluster, router.metrics, lambda: router.stopping)

    for prefix in ("/v1", "/v2"):
        app.add_api_route(prefix + "/{rest:path}", passthrough, methods=["GET", "POST", "DELETE"])
    app.add_api_route("/v2", passthrough, methods=["GET"])
    return app


def run_router(config: RouterConfig) -> int:
    """Serves until SIGTERM/SIGINT; returns the exit code."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health check
    app = create_router_app(config)
    replicas = ", ".join(config.replicas) or config.dns_name

    def listening(port: int) -> None:
        logger.info(
            "router on http://%s:%d, policy %s: %s", config.host, port, config.policy, replicas
        )

    server = _Server(
        uvicorn.Config(app, host=config.host, port=config.port, log_config=None, access_log=False),
        listening,
    )
    asyncio.run(_serve_until_signal(server, app.state.router))
    return 0


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling, which re-raises SIGTERM after shutdown and so
    would kill the process before `--data-parallel-size` stops its replicas; `on_listening` gets
    the port it listens on (the OS's choice for port 0) once it does."""

    def __init__(self, config: uvicorn.Config, on_listening: Callable[[int], None]) -> None:
        super().__init__(config)
        self.on_listening = on_listening

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_listening(listening_port(self, self.config.port))


async def _serve_until_signal(server: uvicorn.Server, router: Router) -> None:
    def stop() -> None:
        router.stopping = True
        server.should_exit = True

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    await server.serve()
