"""The Open Inference Protocol (KServe v2) over HTTP, with Triton's extensions.

    GET  /v2                                          server metadata
    GET  /v2/models                                   ready models (KServe Python's listing)
    GET  /v2/models/{m}[/versions/{v}]                model metadata
    GET  /v2/models/{m}[/versions/{v}]/ready          200 {"ready": true} | 400 {"ready": false}
    GET  /v2/models/{m}[/versions/{v}]/config         Triton-style model configuration
    GET  /v2/models[/{m}[/versions/{v}]]/stats        Triton's statistics extension
    POST /v2/models/{m}[/versions/{v}]/infer          JSON or JSON + binary tensors
    POST /v2/repository/index                         [{"name","version","state","reason"}]
    POST /v2/repository/models/{m}/load | /unload

Image models answer metadata, ready, config, infer and the index too (image_models.py).
(/v2/health/* lives in health.py.) Errors leave as `{"error": "..."}` (errors.py picks the body
by path): 400 bad input, 404 unknown model/version, 429 + Retry-After queue full, 503 not
ready/queue timeout/draining, 500 backend failures only.

Bodies are read raw (never parsed by FastAPI): the binary extension puts tensors after the JSON.
The `receive` stage runs from the request's arrival (the middleware) to the decoded
InferRequest; `stream` from the start of encoding to the last byte handed to the server.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Path, Request
from pydantic import BaseModel
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from inferd.errors import InvalidRequestError, ModelNotFoundError, ModelNotReadyError
from inferd.gateway.contract import json_or_binary, kserve_errors, raw_body
from inferd.gateway.errors import APIError
from inferd.gateway.kserve import codec, compression, raw_request
from inferd.gateway.kserve.contract import (
    AnyObject,
    InferenceRequest,
    InferenceResponse,
    ModelList,
    ModelLoadRequest,
    ModelMetadata,
    ModelReady,
    ModelStatistics,
    RepositoryEntry,
    RepositoryIndexRequest,
    ServerMetadata,
    binary_header,
)
from inferd.gateway.kserve.image_models import Catalog, ServedImageModel
from inferd.gateway.kserve.metadata import server_metadata, stats_targets
from inferd.gateway.responses import FinalizingResponse, json_response
from inferd.gateway.state import GatewayState, gateway
from inferd.telemetry.stages import Stage
from inferd.tensors import InferRequest, InferResponse

if TYPE_CHECKING:
    from inferd.repository.manager import ModelRepository

router = APIRouter(tags=["kserve-v2"])
_MODEL = "/v2/models/{model}"
_VERSION = "/v2/models/{model}/versions/{version}"

ModelName = Annotated[str, Path(description="A model of the repository")]
Version = Annotated[str, Path(description="A version folder's number; absent: the latest")]


async def _model_param(model: ModelName) -> None:
    """Declares {model} in the OpenAPI document (routes read it from `request.path_params`,
    one function serving the path with and without a version)."""


async def _version_params(model: ModelName, version: Version) -> None:
    """Declares {model} and {version} in the OpenAPI document."""


_Route = Callable[[Request], Awaitable[Response]]
BY_MODEL = [Depends(_model_param)]
BY_VERSION = [Depends(_version_params)]
_READ = kserve_errors(404, 503)


def repository(state: GatewayState) -> ModelRepository:
    """The model repository, or 404 when the server runs without one."""
    repo = state.repository
    if repo is None:
        raise ModelNotFoundError(
            "this server serves no model repository (start it with --model-repository DIR)"
        )
    return repo


def _target(request: Request) -> tuple[str, str]:
    params = request.path_params
    return str(params.get("model", "")), str(params.get("version", ""))


@router.get("/v2", response_model=ServerMetadata, responses=kserve_errors())
async def metadata() -> Response:
    return json_response(server_metadata())


@router.get("/v2/models", response_model=ModelList, responses=kserve_errors())
async def list_models(request: Request) -> Response:
    return json_response({"models": Catalog(gateway(request)).model_names()})


# "/v2/models/stats" is declared before the /v2/models/{model} routes, which would otherwise
# take "stats" as a model name.
_STATS: dict[str, Any] = {"response_model": ModelStatistics, "responses": kserve_errors(404)}


@router.get("/v2/models/stats", **_STATS)
@router.get(_MODEL + "/stats", dependencies=BY_MODEL, **_STATS)
@router.get(_VERSION + "/stats", dependencies=BY_VERSION, **_STATS)
async def statistics(request: Request) -> Response:
    state = gateway(request)
    model, version = _target(request)
    targets = stats_targets(repository(state), model, version)
    return json_response(state.model_metrics.statistics(targets))


@router.get(_MODEL, dependencies=BY_MODEL, response_model=ModelMetadata, responses=_READ)
@router.get(_VERSION, dependencies=BY_VERSION, response_model=ModelMetadata, responses=_READ)
async def model_metadata(request: Request) -> Response:
    model, version = _target(request)
    return json_response(Catalog(gateway(request)).metadata(model, version))


_READY: Any = {
    "response_model": ModelReady,
    "responses": {
        **kserve_errors(404),
        400: {"model": ModelReady, "description": "Not ready (loading, unloaded, draining)"},
    },
}


@router.get(_MODEL + "/ready", dependencies=BY_MODEL, **_READY)
@router.get(_VERSION + "/ready", dependencies=BY_VERSION, **_READY)
async def model_ready(request: Request) -> Response:
    """KServe: 200 when ready, a 4xx when not (400, as Triton answers); an unknown model or
    version is 404."""
    state = gateway(request)
    model, version = _target(request)
    try:
        ready = Catalog(state).get(model, version).ready and not state.draining
    except ModelNotReadyError:
        ready = False
    return json_response({"name": model, "ready": ready}, 200 if ready else 400)


@router.get(_MODEL + "/config", dependencies=BY_MODEL, response_model=AnyObject, responses=_READ)
@router.get(
    _VERSION + "/config", dependencies=BY_VERSION, response_model=AnyObject, responses=_READ
)
async def model_config(request: Request) -> Response:
    model, version = _target(request)
    return json_response(Catalog(gateway(request)).config_dict(model, version))


_INFER: dict[str, Any] = {
    "response_model": InferenceResponse,
    "responses": {
        **json_or_binary(InferenceResponse),
        **kserve_errors(400, 404, 413, 429, 503, 500),
    },
    "openapi_extra": {
        **raw_body(InferenceRequest, binary=True),
        "parameters": [
            binary_header(
                "The binary tensor extension: bytes of JSON before the raw tensors; "
                "0: the whole body is the raw tensor of a single-input model"
            )
        ],
    },
}


async def infer(request: Request) -> Response:
    state = gateway(request)
    state.admitting()
    model, version = _target(request)
    repo = Catalog(state)
    body = await _read_body(request, state)
    arrival = float(getattr(request.state, "arrival", time.monotonic()))
    # get -> decode -> infer with no await in between: a reload swapping versions cannot
    # stop the version picked here before the request is admitted to it.
    served = repo.get(model, version)
    infer_request = _decode(request, body, repo, model, served.version)
    infer_request.arrival = arrival
    receive_s = time.monotonic() - arrival
    state.inflight += 1
    try:
        response = await served.infer(infer_request)
        response.timings.set(Stage.RECEIVE, receive_s)
        encode_start = time.monotonic()
        encoded = codec.encode_response(response, infer_request)
        image = isinstance(served, ServedImageModel)
        return _respond(request, state, encoded, response, encode_start, image)
    except BaseException:
        state.inflight -= 1
        raise


# The FastAPI routes only document the path in the OpenAPI schema: inference is served by
# `infer_front`, ahead of the app's router.
router.post(_MODEL + "/infer", dependencies=BY_MODEL, **_INFER)(infer)
router.post(_VERSION + "/infer", dependencies=BY_VERSION, **_INFER)(infer)

_INFER_PATH = re.compile(r"^/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer$")


def infer_path_params(scope: Scope) -> dict[str, str] | None:
    """The path parameters of a POST to an infer path (as the documented routes match it:
    no slash inside a name), else None."""
    if scope["type"] != "http" or scope.get("method") != "POST":
        return None
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    match = _INFER_PATH.match(path)
    if match is None:
        return None
    return {k: v for k, v in match.groupdict().items() if v is not None}


def infer_front(app: FastAPI, gateway_middleware: Callable[[ASGIApp], ASGIApp]) -> ASGIApp:
    """The stack an infer request runs through instead of `app`'s: the app's 500 handler,
    `gateway_middleware` (auth, limits, request id, body limit, access log) and the app's
    exception handlers, in the app's own order, around `infer`.

    What it leaves out is what `infer` has no use for: the router's match against every
    route, the route wrapper, FastAPI's dependency exit stacks, its body limit (the gateway
    middleware's applies) and its own OpenTelemetry layer (inferd's tracing is its own).
    Those were ~10 % of the event loop's time a request at 64 clients of the image example
    (py-spy), where the loop is what bounds requests/s."""
    handlers = {k: v for k, v in app.exception_handlers.items() if k not in (500, Exception)}
    inner = ExceptionMiddleware(_InferApp(), handlers=handlers, debug=app.debug)
    last_resort = app.exception_handlers.get(Exception, app.exception_handlers.get(500))
    return ServerErrorMiddleware(gateway_middleware(inner), handler=last_resort, debug=app.debug)


class _InferApp:
    """`infer` as a bare ASGI app."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await infer(Request(scope, receive, send))
        await response(scope, receive, send)


async def _read_body(request: Request, state: GatewayState) -> bytes:
    body = await request.body()
    try:
        return compression.decompress(
            body, request.headers.get("content-encoding"), state.server.max_body_bytes
        )
    except compression.BodyTooLargeError as e:
        raise APIError(413, str(e), code="request_too_large", reason="too_large") from None


def _decode(request: Request, body: bytes, repo: Catalog, model: str, version: str) -> InferRequest:
    header_length = request.headers.get(codec.HEADER_LENGTH)
    if codec.is_raw_request(header_length):
        spec = raw_request.raw_input_spec(repo.config_dict(model, version))
        return raw_request.decode_raw_request(body, spec, model, version)
    return codec.decode_request(body, header_length, model, version)


def _respond(
    request: Request,
    state: GatewayState,
    encoded: codec.EncodedResponse,
    response: InferResponse,
    encode_start: float,
    image: bool,
) -> Response:
    """`image`: an image model's response (its request was recorded as an image request, so
    the classic models' metrics leave it out)."""
    body, headers = encoded.body, dict(encoded.headers)
    encoding = compression.choose_encoding(request.headers.get("accept-encoding"))
    if encoding is not None and len(body) >= compression.MIN_COMPRESS_BYTES:
        body = compression.compress(body, encoding)
        headers["Content-Encoding"] = encoding

    async def done() -> None:
        state.inflight -= 1
        stream_s = time.monotonic() - encode_start
        if not image:
            state.model_metrics.observe_gateway(
                response.model_name, response.timings.seconds[Stage.RECEIVE], stream_s
            )
        if state.server.access_log:  # its only reader (no tokens to charge on this lane)
            request.state.access_extra = {
                "model": response.model_name,
                "model_version": response.model_version,
                "timings": {**response.timings.as_dict(digits=None), "stream": stream_s},
            }

    return FinalizingResponse(body, done, encoded.media_type, headers)


@router.post(
    "/v2/repository/index",
    response_model=list[RepositoryEntry],
    responses=kserve_errors(400, 413),
    openapi_extra=raw_body(RepositoryIndexRequest, required=False),
)
async def repository_index(request: Request) -> Response:
    """Body optional: `{"ready": true}` lists only the models that are ready."""
    doc = await _optional_json(request)
    ready_only = doc.get("ready", False)
    if not isinstance(ready_only, bool):
        raise InvalidRequestError("'ready' must be true or false", "ready")
    entries = Catalog(gateway(request)).index()
    if ready_only:
        entries = [e for e in entries if e.get("state") == "READY"]
    return json_response(entries)


def _admin_route(path: str, body: type[BaseModel]) -> Callable[[_Route], _Route]:
    """POST of the repository API: an optional JSON body, `{}` back, admin scope."""
    return router.post(
        path,
        dependencies=BY_MODEL,
        response_model=AnyObject,
        responses=kserve_errors(400, 403, 404, 413, 503),
        openapi_extra=raw_body(body, required=False),
    )


@_admin_route("/v2/repository/models/{model}/load", ModelLoadRequest)
async def load_model(request: Request) -> Response:
    """Reloads the model from disk. Triton's `config` / `file:` parameters (a config or files
    sent inline) are refused: they would silently not apply."""
    state = gateway(request)
    state.admitting()
    doc = await _optional_json(request)
    params = doc.get("parameters")
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise InvalidRequestError("'parameters' must be an object", "parameters")
    inline = [k for k in params if k == "config" or k.startswith("file:")]
    if inline:
        raise InvalidRequestError(
            f"loading with {inline} is not supported: edit the model's config.yaml and files "
            "in the repository, then load"
        )
    await repository(state).load(request.path_params["model"])
    return json_response({})


@_admin_route("/v2/repository/models/{model}/unload", AnyObject)
async def unload_model(request: Request) -> Response:
    """`unload_dependents` and other parameters are accepted and have no effect (inferd has no
    ensembles, so nothing depends on a model)."""
    await _optional_json(request)
    await repository(gateway(request)).unload(request.path_params["model"])
    return json_response({})


async def _optional_json(request: Request) -> dict[str, Any]:
    body = await request.body()
    return codec.parse_json_object(body) if body.strip() else {}
