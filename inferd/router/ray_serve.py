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
- `CacheAwareRequestRouter` is a Ray Serve `RequestRouter` (alpha API, ray >= 2.50) whose
  decision is `inferd.router.cluster.Cluster.route`: the same prefix index, token-load
  accounting and policy (`cache_aware` by default). Each ingress replica holds its own router
  state, as several `inferd router` instances do. Its decision (time, replica, the cached tokens
  the index expected) reaches the ingress through inferd.router.route_notes, which adds the
  `route` stage to the answer's `timings` and `x-inferd-route-cached-tokens`, as `inferd router`
  does. Its metrics (`inferd_router_*`) are the ingress's `GET /router/metrics`
  (router/ray_metrics.py).

Serve's default `max_ongoing_requests` (5) would starve continuous batching; replicas take the
engine's `max_num_seqs + max_queued_requests` unless told otherwise.

    inferd serve --ray --num-replicas 2 inferd-tiny     (inferd.router.ray_launch)
    serve run inferd.router.ray_serve:app_builder num_replicas=2 model=inferd-tiny
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from inferd.config import EngineConfig, ServeConfig, read_environment
from inferd.router.cluster import Cluster, Routed
from inferd.router.config import RouterConfig
from inferd.router.load import ReplicaReport, Ticket
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

    async def __init__(self, config: ServeConfig) -> None:  # type: ignore[misc]
        from inferd.engine.async_client import AsyncLLM
        from inferd.gateway.app import create_app, set_engine

        assert config.engine is not None  # build_app refuses a config without an LLM
        self._grace_s = config.server.shutdown_timeout_s
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

    def record_routing_stats(self) -> dict[str, float]:
        """Serve polls this; the router reads it as the replica's own load report."""
        s = self._llm.stats()
        return {
            "running": s.running,
            "waiting": s.waiting,
            "queued": s.queued,
            "queued_prompt_tokens": s.queued_prompt_tokens,
            "kv_cache_usage": s.kv_cache_usage,
            # Bounds the router's index for this replica at its real KV capacity.
            "num_blocks": self._llm.info.num_kv_blocks,
        }

    async def __del__(self) -> None:
        """Serve's graceful shutdown awaits this: drain, then stop the engine core process."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        await self._llm.drain(self._grace_s)
        await self._llm.shutdown()


# -- the request router -----------------------------------------------------------------------


def _report(stats: Mapping[str, Any]) -> ReplicaReport:
    return ReplicaReport(
        running=int(stats.get("running", 0)),
        waiting=int(stats.get("waiting", 0)),
        queued=int(stats.get("queued", 0)),
        queued_prompt_tokens=int(stats.get("queued_prompt_tokens", 0)),
        kv_cache_usage=float(stats.get("kv_cache_usage", 0.0)),
        num_blocks=int(stats["num_blocks"]) if "num_blocks" in stats else None,
    )


def _token_ids(pending: PendingRequest | None) -> tuple[int, ...]:
    # By attribute, not isinstance: the ingress's copy of ForwardedRequest may be a by-value
    # (cloudpickled) class, distinct from this module's.
    for arg in pending.args if pending is not None else ():
        token_ids = getattr(arg, "token_ids", None)
        if isinstance(token_ids, tuple):
            return token_ids
    return ()


class CacheAwareRequestRouter(RequestRouter):
    """Ray Serve's replica choice made by inferd's `Cluster`: replicas are named by their full
    Serve replica id; Serve's replica set is the membership (a replica that dies leaves at once,
    with its prefix index). The returned ranks hold one replica each, so Serve falls back down
    the policy's own ranking when a replica is at `max_ongoing_requests`."""

    # Decisions waiting for on_request_routed, by Serve's internal request id; bounded because
    # a request cancelled while queued in Serve is never routed.
    _MAX_PENDING = 10_000

    def initialize_state(self, **kwargs: Any) -> None:
        """`kwargs`: RouterConfig fields (`policy`, `block_size`, `index_capacity_blocks`,
        `decode_weight`, `balance_abs_threshold`, `balance_rel_threshold`, `seed`)."""
        from inferd.router.ray_metrics import SLOT  # the process's own (see Ingress.forward)

        # RouterConfig insists on a replica; Serve's replica set replaces it below.
        self._cluster = Cluster(RouterConfig(replicas=("ray://pending",), **kwargs))
        self._cluster.set_members(())
        self._metrics = SLOT.attach(self._cluster)
        # With each decision its time (the `route` stage's share spent here).
        self._pending: OrderedDict[str, tuple[Routed, float]] = OrderedDict()
        self._open: dict[str, deque[Ticket]] = {}

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._cluster.set_members(r.replica_id.to_full_id_str() for r in replicas)
        for name in self._cluster.names():
            self._cluster.set_health(name, ready=True)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        if self._cluster.failed(replica_id.to_full_id_str(), "actor_died"):
            self._metrics.ejections.labels(replica_id.to_full_id_str(), "actor_died").inc()
        self._open.pop(replica_id.to_full_id_str(), None)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        t0 = time.perf_counter()
        by_name = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        for name, replica in by_name.items():
            self._cluster.report(name, _report(replica.routing_stats or {}))
            self._cluster.set_health(name, ready=True)  # Serve offers only live replicas
        skip = [n for n in self._cluster.names() if n not in by_name]
        routed = self._cluster.route(_token_ids(pending_request), exclude=skip)
        if pending_request is not None:
            decided = (routed, time.perf_counter() - t0)
            self._pending[pending_request.metadata.internal_request_id] = decided
            while len(self._pending) > self._MAX_PENDING:
                self._pending.popitem(last=False)
        return [[by_name[name]] for name in routed.decision.ranking]

    async def _choose_replica_for_request(
        self, pending_request: PendingRequest, *, is_retry: bool = False
    ) -> RunningReplica:
        """Serve's own choice (its FIFO may hand this request the replica another request's
        ranking found), then the dispatch bookkeeping on the replica it really goes to.

        Overrides a private method: Serve (2.60) calls the public `on_request_routed` only with
        strict max_ongoing_requests on, and this is the one place that sees every (request,
        replica) pair."""
        # Imported here, as in Ingress.forward: the process's own notes, whichever copy of
        # this class Serve shipped.
        from inferd.router.route_notes import NOTES, RouteNote

        replica: RunningReplica = await super()._choose_replica_for_request(
            pending_request, is_retry=is_retry
        )
        name = replica.replica_id.to_full_id_str()
        request_id = pending_request.metadata.internal_request_id
        routed, decision_s = self._pending.pop(request_id, (None, 0.0))
        if name in self._cluster.replicas:
            if routed is None:  # routed while another request's decision was pending
                routed = self._cluster.route(_token_ids(pending_request))
            ticket = self._cluster.dispatch(name, routed)
            self._open.setdefault(name, deque()).append(ticket)
            self._metrics.count(name, routed)
            self._metrics.decision.observe(decision_s)
            cached = routed.prompt_tokens - ticket.prefill_tokens
            NOTES.put(request_id, RouteNote(decision_s, name, cached))
        return replica

    def decrement_queue_len_cache(self, replica_id: ReplicaID) -> None:
        """Serve calls this when any request on the replica ends: its oldest open ticket ends
        (requests on one replica differ only in prefill tokens, already counted down by then)."""
        super().decrement_queue_len_cache(replica_id)
        if tickets := self._open.get(replica_id.to_full_id_str()):
            tickets.popleft().finish()


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
        request_router_class=f"{__name__}:CacheAwareRequestRouter",  # type: ignore[arg-type]
        request_router_kwargs={
            "policy": options.policy,
            # The replicas' own block size, or no block hash ever matches.
            "block_size": engine.cache.block_size,
            "index_capacity_blocks": options.index_capacity_blocks,
            "decode_weight": options.decode_weight,
            "seed": options.seed,
            "sees_first_byte": False,  # Serve shows the router only a request's end
        },
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
    ).bind(config)
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
