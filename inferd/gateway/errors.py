"""inferd's error taxonomy -> HTTP status and each protocol's error body.

OpenAI's, on every path but /v2:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": "invalid_value"}}

The Open Inference Protocol's (KServe v2, what tritonclient parses), on /v2 and /v2/*:

    {"error": "..."}

The status is the same for both. Bad input is always a 4xx found before queueing; 500 is reserved
for bugs and backend failures (logged with a traceback).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from inferd.errors import (
    DrainingError,
    EngineDeadError,
    InferdError,
    InvalidRequestError,
    ModelLoadError,
    ModelNotFoundError,
    ModelNotReadyError,
    OutputBacklogError,
    QueueFullError,
    QueueTimeoutError,
)

logger = logging.getLogger("inferd.gateway")


@dataclass(eq=False)
class APIError(Exception):
    """An error already mapped to its HTTP form; `reason` labels inferd_requests_rejected_total."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    reason: str = "invalid"
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def kserve_body(self) -> dict[str, Any]:
        return {"error": self.message}

    def response(self, kserve: bool = False) -> Response:
        """`kserve`: the Open Inference Protocol's body (see `is_kserve_path`)."""
        return Response(
            orjson.dumps(self.kserve_body() if kserve else self.body()),
            status_code=self.status,
            media_type="application/json",
            headers=self.headers or None,
        )


def is_kserve_path(path: str) -> bool:
    """Paths of the Open Inference Protocol, whose clients expect `{"error": "..."}`."""
    return path == "/v2" or path.startswith("/v2/")


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model {model!r} does not exist",
        type="not_found_error",
        param="model",
        code="model_not_found",
        reason="not_found",
    )


def unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, type="service_unavailable", code=code, reason=code)


def to_api_error(exc: BaseException) -> APIError:
    """Maps any exception to its API form; unknown ones become a 500 (a bug)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, QueueFullError):
        seconds = max(1, math.ceil(exc.retry_after))
        return APIError(
            429,
            str(exc),
            type="rate_limit_error",
            code="queue_full",
            reason="queue_full",
            headers={"Retry-After": str(seconds)},
        )
    if isinstance(exc, QueueTimeoutError):
        return unavailable(str(exc) or "the request waited past its deadline", "queue_timeout")
    if isinstance(exc, DrainingError):
        return unavailable(str(exc) or "the server is shutting down", "draining")
    if isinstance(exc, EngineDeadError):
        return unavailable(str(exc) or "the engine process died", "engine_dead")
    if isinstance(exc, OutputBacklogError):
        return APIError(500, str(exc), type="server_error", code="output_backlog", reason="invalid")
    return _model_error(exc)


def _model_error(exc: BaseException) -> APIError:
    """The classic-model path's errors (model repository, backends)."""
    if isinstance(exc, ModelNotFoundError):
        return APIError(
            404, str(exc), type="not_found_error", code="model_not_found", reason="not_found"
        )
    if isinstance(exc, ModelNotReadyError):
        return unavailable(str(exc) or "the model is not ready", "not_ready")
    if isinstance(exc, ModelLoadError):
        # A load the client asked for (POST /v2/repository/models/{m}/load) failed: Triton
        # answers 400 with the reason, and the old versions stay served.
        return APIError(400, str(exc), code="model_load_failed", reason="invalid")
    if isinstance(exc, InferdError):
        # Raised on purpose but not the client's fault (a backend failing on a batch).
        message = str(exc) or "internal server error"
        return APIError(500, message, type="server_error", code="internal_error")
    return APIError(500, "internal server error", type="server_error", code="internal_error")


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return bad_request(f"malformed JSON: {first.get('msg', '')}", None, "invalid_json")
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    return bad_request(f"{param}: {msg}" if param else str(msg), param)


_HTTP_TYPES = {
    401: ("authentication_error", "invalid_api_key", "unauthorized"),
    404: ("not_found_error", "not_found", "not_found"),
    405: ("invalid_request_error", "method_not_allowed", "invalid"),
    413: ("invalid_request_error", "request_too_large", "too_large"),
}


def _http_error(exc: StarletteHTTPException) -> APIError:
    etype, code, reason = _HTTP_TYPES.get(
        exc.status_code, ("invalid_request_error", "invalid_request", "invalid")
    )
    if exc.status_code >= 500:
        etype, code, reason = "server_error", "internal_error", "invalid"
    headers = dict(exc.headers or {})
    return APIError(exc.status_code, str(exc.detail), etype, None, code, reason, headers)


def install_error_handlers(app: FastAPI, on_reject: Any = None) -> None:
    """Every error leaves as OpenAI's error JSON, or KServe's on /v2 paths.

    `on_reject(reason)` counts 4xx/503 refusals."""

    def respond(request: Request, err: APIError) -> Response:
        if on_reject is not None and err.status != 500:
            on_reject(err.reason)
        return err.response(kserve=is_kserve_path(request.url.path))

    async def api_error(request: Request, exc: Exception) -> Response:
        err = to_api_error(exc)
        if err.status == 500:
            logger.error("%s on %s %s", err.message, request.method, request.url.path, exc_info=exc)
        return respond(request, err)

    async def validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return respond(request, _validation_error(exc))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return respond(request, _http_error(exc))

    async def unhandled(request: Request, exc: Exception) -> Response:
        err = to_api_error(exc)
        if err.status == 500:
            logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return respond(request, err)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(InferdError, api_error)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unhandled)
