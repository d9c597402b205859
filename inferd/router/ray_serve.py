"""Ray Serve: N inferd engine replicas as one Serve deployment, routed by the same cache-aware
policy as `inferd router` (the `inferd[ray]` extra).

Two deployments:

    HTTP -> Serve proxy -> Ingress (tokenizes) --handle--> EngineReplica x N (inferd's app)
                                    ^ CacheAwareRequestRouter picks the replica

- `EngineReplica` runs inferd's own FastAPI app and engine in the replica process and answers
  one HTTP request per call by driving that app over ASGI, so responses, errors, timings and
  streaming are byte-for-byte a replica's (`call_asgi`).
- `Ingress` tokenizes each OpenAI request exactly as `inferd router` does (inferd.router.tokenize:
  chat template over the whole history) and hands the request with its prompt token ids to the
  engine deployment's handle. A body it cannot read is routed on load alone; the replica answers
  it with its own 4xx.
- `CacheAwareRequestRouter` (router/ray_request_router.py) is a Ray Serve `RequestRouter` (alpha
  API, ray >= 2.50) whose decision is `inferd.router.cluster.Cluster.route`: the same prefix
  index, token-load accounting and policy (`cache_aware` by default). Each ingress replica holds
  its own router state, as several `inferd router` instances do. Its decision (time, replica, the
  cached tokens the index expected) reaches the ingress through inferd.router.route_notes, which
  adds the `route` stage to the answer's `timings` and `x-inferd-route-cached-tokens`, as `inferd
  router` does. Its metrics (`inferd_router_*`) are the ingress's `GET /router/metrics`
  (router/ray_metrics.py).

Serve's default `max_ongoing_requests` (5) would starve continuous batching; replicas take the
engine's `max_num_seqs + max_queued_requests` unless told otherwise.

Replica reports come through Serve's routing stats (`EngineReplica.record_routing_stats`, polled
every `routing_stats_period_s`, 2 s as `inferd router`'s health interval, not Serve's 10): the
engine's load gauges and its block digest (gateway/kv_cache.py's hashes), which resets the
router's approximate index of that replica as `inferd router`'s health checks do
(router/index.py, `snapshot`).

    inferd serve --ray --num-replicas 2 inferd-tiny     (inferd.router.ray_launch)
    serve run inferd.router.ray_serve:app_builder num_replicas=2 model=inferd-tiny
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application
from ray.serve.handle import DeploymentHandle

from inferd.config import EngineConfig, ServeConfig, read_environment
from inferd.router.config import RouterConfig
from inferd.router.policy import PolicyName

logger = logging.getLogger("inferd.router.ray")

# An ASGI message: a dict with a "type" key (the spec's own shape).
Message = dict[str, Any]


@dataclass(frozen=True)
class ForwardedRequest:
    """One HTTP request as the ingress hands it to an engine replica; `token_ids` is the prompt
    the router matches (empty: route on load alone)."""

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ResponseStart:
    """The first item an engine replica yields; body chunks (bytes) follow."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]


# -- the engine replica -----------------------------------------------------------------------


def _scope(request: ForwardedRequest) -> Message:
    return {
        "type": "http",
        # spec 2.3: Starlette listens on receive() for the disconnect that cancels a stream.
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query_string,
        "root_path": "",
        "headers": [list(h) for h in request.headers],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        "state": {},
    }


async def call_asgi(
    app: Callable[..., Any], request: ForwardedRequest
) -> AsyncIterator[ResponseStart | bytes]:
    """Runs `request` through the ASGI `app` in this process: yields its ResponseStart, then each
    body chunk as the app sends it (no buffering). Closing the iterator early (the client went
    away) tells the app the client disconnected, which aborts the request in the engine."""
    queue: asyncio.Queue[Message | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await queue.put(message)

    async def run() -> None:
        try:
            await app(_scope(request), receive, send)
        finally:
            await queue.put(None)

    task = asyncio.create_task(run())
    try:
        async for part in _response(queue):
            yield part
        await task
    finally:
        disconnected.set()
        if not task.done():
            # The app's own disconnect handling aborts the engine request; this is the backstop.
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), 1.0)
            task.cancel()


async def _response(queue: asyncio.Queue[Message | None]) -> AsyncIterator[ResponseStart | bytes]:
    """The app's send() messages as a ResponseStart and body chunks, up to the last chunk."""
    while (message := await queue.get()) is not None:
        if message["type"] == "http.response.start":
            headers = tuple((bytes(k), bytes(v)) for k, v in message.get("headers", ()))
            yield ResponseStart(int(message["status"]), headers)
        elif message["type"] == "http.response.body":
            if chunk := message.get("body", b""):
                yield bytes(chunk)
            if not message.get("more_body", False):
                return


class EngineReplica:
    """One inferd server (gateway app + engine core process) inside a Serve replica, run with
    `inferd serve`'s config tree. Serves the LLM lane only: no model repository, no gRPC, no
    port of its own (its host/port are the Serve proxy's)."""

    async def __init__(  # type: ignore[misc]
        self, config: ServeConfig, digest_recent_s: float = 2 * RouterConfig.health_interval_s
    ) -> None:
        from inferd.engine.async_client import AsyncLLM
        from inferd.gateway.app import create_app, set_engine

        assert config.engine is not None  # build_app refuses a config without an LLM
        self._grace_s = config.server.shutdown_timeout_s
        # The digest's `num_recent` window: two polls (router/index.py's live blocks).
        self._digest_recent_s = digest_recent_s
        self._app = create_app(None, config.server)
        # No env=config.env: a replica may run on another node, whose environment (cache
        # folders, tokens) is the one that counts; AsyncLLM reads it there.
        self._llm = await AsyncLLM.start(
            config.engine, config.admission, served_model_name=config.server.served_model_name
        )
        set_engine(self._app, self._llm)
        # Which replica answered, as `inferd router` says it (x-inferd-replica).
        self._name = serve.get_replica_context().replica_id.to_full_id_str().encode()
        self._closed = False

    async def handle(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        async for part in call_asgi(self._app, request):
            if isinstance(part, ResponseStart):
                part = ResponseStart(
                    part.status, (*part.headers, (b"x-inferd-replica", self._name))
                )
            yield part

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve polls this; the router reads it as the replica's own load report and, with
        `digest_at` (wall-clock seconds when it was asked for), its block digest."""
        from inferd.errors import EngineDeadError

        s = self._llm.stats()
        num_blocks = self._llm.info.num_kv_blocks
        stats: dict[str, Any] = {
            "running": s.running,
            "waiting": s.waiting,
            "queued": s.queued,
            "queued_prompt_tokens": s.queued_prompt_tokens,
            "kv_cache_usage": s.kv_cache_usage,
            # Bounds the router's index for this replica at its real KV capacity.
            "num_blocks": num_blocks,
        }
        asked_at = time.time()
        with contextlib.suppress(EngineDeadError, TimeoutError):
            digest = await self._llm.kv_blocks(num_blocks, self._digest_recent_s)
            # Without prefix caching it is empty: the truth (nothing is reused there).
            stats["digest_at"] = asked_at
            stats["block_hashes"] = digest.block_hashes
            stats["num_recent"] = digest.num_recent
        return stats

    async def __del__(self) -> None:
        """Serve's graceful shutdown awaits this: drain, then stop the engine core process."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        await self._llm.drain(self._grace_s)
        await self._llm.shutdown()


# -- the ingress ------------------------------------------------------------------------------

_api = FastAPI(title="inferd (Ray Serve ingress)", docs_url=None, redoc_url=None)
_METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]


class Ingress:
    """Tokenizes OpenAI requests for the router and streams the chosen replica's answer back."""

    def __init__(
        self, engine: DeploymentHandle[Any], model: str, tokenizer: str | None, revision: str | None
    ) -> None:
        from inferd.router.tokenize import load_tokenizer

        self._engine = engine.options(stream=True, method_name="handle")
        self._tok = load_tokenizer(model, tokenizer, revision)

    def token_ids(self, path: str, body: bytes) -> tuple[int, ...]:
        """The prompt a replica will prefill; () when the body is not one the router reads."""
        from inferd.router.tokenize import TOKENIZED_PATHS, prompt_token_ids, validate

        if path not in TOKENIZED_PATHS:
            return ()
        try:
            return tuple(prompt_token_ids(self._tok, validate(path, json.loads(body))))
        except Exception:  # the replica answers a body it cannot read with its own 4xx
            return ()

    # Registered before the catch-all below, so it is matched first.
    @_api.get("/router/metrics", include_in_schema=False)
    async def router_metrics(self) -> Response:
        """The request router's own metrics (router/ray_metrics.py)."""
        from inferd.router.ray_metrics import SLOT

        body = SLOT.exposition() or b""
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @_api.api_route("/{path:path}", methods=_METHODS, include_in_schema=False)
    async def forward(self, request: Request) -> Response:
        # Imported here: Serve ships these classes by value, module-level names with them (a
        # copy each); the notes must be the process's own, shared with the request router.
        from inferd.router.route_notes import NOTES, rewrites, with_route_timing

        body = await request.body()
        path = request.url.path
        t0 = time.perf_counter()
        token_ids = self.token_ids(path, body)
        tokenize_s = time.perf_counter() - t0
        forwarded = ForwardedRequest(
            method=request.method,
            path=path,
            query_string=request.url.query.encode(),
            headers=tuple(request.headers.raw),
            body=body,
            token_ids=token_ids,
        )
        parts: Any = self._engine.remote(forwarded)
        start = await parts.__anext__()
        assert isinstance(start, ResponseStart)
        # The router's note for this request (the handle call carried this internal id).
        note = NOTES.take(serve.context._get_serve_request_context()._internal_request_id)
        # Serve's proxy sets x-request-id itself (the same id: it passed it to the replica).
        headers = [h for h in start.headers if h[0] != b"x-request-id"]
        stream = _body(parts)
        if note is not None and token_ids:
            content_type = dict(headers).get(b"content-type", b"").decode()
            stream = with_route_timing(stream, content_type, tokenize_s + note.decision_s)
            if rewrites(content_type):  # the length changes
                headers = [h for h in headers if h[0] != b"content-length"]
            headers.append((b"x-inferd-route-cached-tokens", str(note.cached_tokens).encode()))
        response = StreamingResponse(stream, status_code=start.status)
        response.raw_headers = headers
        return response


async def _body(parts: Any) -> AsyncIterator[bytes]:
    async for chunk in parts:
        yield chunk


# -- building the application -----------------------------------------------------------------


@dataclass(frozen=True)
class RayServeOptions:
    """What `build_app` makes: `num_replicas` engine replicas, each serving `config`."""

    config: ServeConfig
    num_replicas: int = 2
    # None: the engine's max_num_seqs + max_queued_requests (what it can hold without a 503).
    max_ongoing_requests: int | None = None
    policy: PolicyName = "cache_aware"
    # Ray CPUs each engine replica reserves (its engine core process is not counted by Ray).
    replica_num_cpus: float = 1.0
    index_capacity_blocks: int = RouterConfig.index_capacity_blocks
    decode_weight: int = RouterConfig.decode_weight
    seed: int | None = None
    # How often Serve polls each replica's load and block digest (record_routing_stats).
    routing_stats_period_s: float = RouterConfig.health_interval_s


def build_app(options: RayServeOptions) -> Application:
    """The Serve application: the ingress bound to `num_replicas` engine replicas."""
    config, engine = options.config, options.config.engine
    if engine is None:
        raise ValueError("Ray Serve runs the LLM lane only: name a model")
    ongoing = options.max_ongoing_requests or (
        engine.scheduler.max_num_seqs + config.admission.max_queued_requests
    )
    router = RequestRouterConfig(
        # ray types this field oddly (dict); it takes an import path or a class.
        request_router_class="inferd.router.ray_request_router:CacheAwareRequestRouter",  # type: ignore[arg-type]
        request_router_kwargs={
            "policy": options.policy,
            # The replicas' own block size, or no block hash ever matches.
            "block_size": engine.cache.block_size,
            "index_capacity_blocks": options.index_capacity_blocks,
            "decode_weight": options.decode_weight,
            "seed": options.seed,
            "sees_first_byte": False,  # Serve shows the router only a request's end
        },
        request_routing_stats_period_s=options.routing_stats_period_s,  # type: ignore[arg-type]
    )
    replicas = EngineDeployment.options(
        num_replicas=options.num_replicas,
        max_ongoing_requests=ongoing,
        max_queued_requests=-1,  # unbounded in Serve: the replicas' admission queues bound it
        request_router_config=router,
        ray_actor_options={"num_cpus": options.replica_num_cpus},
        # A cold replica loads weights and starts its engine process before it is healthy.
        health_check_timeout_s=60.0,
        graceful_shutdown_timeout_s=config.server.shutdown_timeout_s + 5.0,
    ).bind(config, 2 * options.routing_stats_period_s)
    model = engine.model
    return IngressDeployment.options(
        max_ongoing_requests=options.num_replicas * ongoing,
        ray_actor_options={"num_cpus": 0},
    ).bind(replicas, model.model, model.tokenizer, model.revision)


_BUILDER_ARGS = ("num_replicas", "max_ongoing_requests", "policy", "replica_num_cpus")


def app_builder(args: dict[str, str]) -> Application:
    """Serve's application-builder hook; engine settings go by `inferd.LLM`'s keyword names:

        serve run inferd.router.ray_serve:app_builder num_replicas=2 model=inferd-tiny \
            max_num_seqs=64

    Everything but the builder's own arguments goes to `EngineConfig.from_kwargs` (which
    refuses unknown names and converts the strings)."""
    engine = {k: v for k, v in args.items() if k not in _BUILDER_ARGS}
    ongoing = args.get("max_ongoing_requests")
    return build_app(
        RayServeOptions(
            config=ServeConfig(
                env=read_environment(),
                engine=EngineConfig.from_kwargs(**{"model": "inferd-tiny", **engine}),
            ),
            num_replicas=int(args.get("num_replicas", 2)),
            max_ongoing_requests=int(ongoing) if ongoing else None,
            policy=args.get("policy", "cache_aware"),  # type: ignore[arg-type]
            replica_num_cpus=float(args.get("replica_num_cpus", 1.0)),
        )
    )


EngineDeployment = serve.deployment(name="inferd-engine")(EngineReplica)
IngressDeployment = serve.deployment(name="inferd-ingress")(serve.ingress(_api)(Ingress))
