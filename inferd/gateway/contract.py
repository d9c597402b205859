"""What /openapi.json promises: every route's bodies, its errors and their status codes.

Shared here: the error bodies, health, how raw and streamed bodies are declared, and the
document itself; each protocol's own bodies are in openai/contract.py and kserve/contract.py.

The document is a contract (client generators, gateways and schemathesis read it), built by
FastAPI from the pydantic models here and the routes' `responses=` declarations, never written
by hand:

    @router.post("/v2/models/{model}/infer", responses=kserve_errors(400, 404, 413, 429, 503, 500))

Rules it keeps:
- Errors are each protocol's own body: OpenAI's `{"error": {"message", "type", "param",
  "code"}}` on every path but /v2, KServe's `{"error": "..."}` on /v2 (see errors.py).
- Every status a route can answer is listed; 401 and 429 (API keys configured: no valid one
  sent, or over the key's limits) on every route outside health, metrics and the docs, 403 on
  the admin ones. FastAPI's default 422 is dropped: inferd
  answers validation errors with 400 (`openapi_document`).
- Request schemas are exactly as strict as the real validation: what they allow is accepted or
  answered with a listed 4xx that depends on the model (an unknown input name, a prompt past the
  context window); what they refuse, the server refuses with 400.
- Routes that read their body raw (KServe: JSON may be followed by binary tensors) declare it
  with `raw_body(Model)`, the model's JSON schema inlined.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

Responses = dict[int | str, dict[str, Any]]

# -- errors ------------------------------------------------------------------------------------

_WHY = {
    400: "Bad input (malformed JSON, wrong types or values), refused before queueing",
    401: "API keys are configured and no valid `Authorization: Bearer <key>` was sent",
    403: "The API key lacks the admin scope this route needs",
    404: "Unknown model or version",
    413: "The request body is larger than --max-body-bytes",
    429: "The queue is full, or the API key is over one of its limits; retry after "
    "`Retry-After` seconds",
    500: "A bug or a backend failure not caused by the request (logged)",
    503: "Not ready (loading, unloaded, engine died), draining, or the request waited past "
    "its deadline (`timeout`, or the server's --request-timeout)",
}
_RETRY_AFTER = {
    "Retry-After": {"description": "Seconds to wait", "schema": {"type": "integer", "minimum": 1}}
}
# Every route but health, metrics and the docs needs an API key when keys are configured, and
# counts against the key's limits (auth.py).
GUARDED = (401, 429)


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(BaseModel):
    """OpenAI's error body, on every path but /v2."""

    error: OpenAIErrorDetail


class KServeError(BaseModel):
    """The Open Inference Protocol's error body, on /v2 and /v2/*."""

    error: str


def openai_errors(*statuses: int) -> Responses:
    """`responses=` for an OpenAI route: the statuses given plus GUARDED, OpenAI's body."""
    return _errors(OpenAIError, (*statuses, *GUARDED))


def kserve_errors(*statuses: int, guarded: bool = True) -> Responses:
    """`responses=` for a KServe route: the statuses given (plus GUARDED), KServe's body."""
    return _errors(KServeError, (*statuses, *(GUARDED if guarded else ())))


def _errors(model: type[BaseModel], statuses: tuple[int, ...]) -> Responses:
    out: Responses = {}
    for status in sorted(set(statuses)):
        out[status] = {"model": model, "description": _WHY[status]}
        if status == 429:
            out[status]["headers"] = _RETRY_AFTER
    return out


# -- bodies that are read raw ------------------------------------------------------------------


def raw_body(
    model: type[BaseModel], *, required: bool = True, binary: bool = False
) -> dict[str, Any]:
    """`openapi_extra=` declaring a request body the route parses itself.

    `binary`: also `application/octet-stream`, the KServe binary tensor extension (the JSON
    followed by raw tensors; `Inference-Header-Content-Length` says where the JSON ends)."""
    schema = inline_refs(model.model_json_schema())
    content: dict[str, Any] = {"application/json": {"schema": schema}}
    if binary:
        content["application/octet-stream"] = {"schema": {"type": "string", "format": "binary"}}
    return {"requestBody": {"required": required, "content": content}}


def inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema with its `#/$defs/...` references replaced by their definitions
    (in an OpenAPI document `#/` is the document's root, not the schema's). The models here
    are not recursive."""
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    resolved: dict[str, Any] = resolve(schema)
    return resolved


class OpenModel(BaseModel):
    """A body whose extra keys are accepted (and ignored), as the server does."""

    model_config = ConfigDict(extra="allow")


# -- health ------------------------------------------------------------------------------------


class Status(BaseModel):
    status: Literal["live", "ready", "loading", "draining", "engine_dead", "not_ready"]


class V2Live(BaseModel):
    live: bool


class V2Ready(BaseModel):
    ready: bool


# One server-sent event (OpenAPI 3.1: a text/event-stream `schema` describes each event).
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {
            "type": "string",
            "description": 'A chunk (JSON), an `{"error": {...}}` object, or `[DONE]`',
        }
    },
}


def json_or(media_type: str, model: type[BaseModel], description: str) -> Responses:
    """A 200 that is `model` as JSON, or a body of `media_type` (`description` says when)."""
    schema = _SSE_EVENT if media_type == "text/event-stream" else {"type": "string"}
    content = {media_type: {"schema": schema}}
    return {200: {"model": model, "description": description, "content": content}}


def sse_or_json(model: type[BaseModel]) -> Responses:
    """200 of a generation route: `model` as JSON, or `data: {chunk}` events when stream."""
    why = "The completion; with `stream: true` server-sent events (`data: {chunk}`, then "
    return json_or("text/event-stream", model, why + "`data: [DONE]`)")


def json_or_binary(model: type[BaseModel]) -> Responses:
    """200 of KServe infer: JSON, or with binary outputs the JSON header then raw tensors."""
    why = "JSON; when an output goes binary, `application/octet-stream`: the JSON "
    return json_or(
        "application/octet-stream",
        model,
        why + "(its length in the `Inference-Header-Content-Length` header), then the raw outputs",
    )


# -- the document ------------------------------------------------------------------------------


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document without its default 422 responses: inferd answers a body that fails
    validation with 400 in the protocol's error body (errors.py), which every route lists."""
    if app.openapi_schema is None:
        doc = get_openapi(
            title=app.title,
            version=app.version,
            summary=app.summary,
            description=app.description,
            routes=app.routes,
        )
        for ops in doc.get("paths", {}).values():
            for op in ops.values():
                op.get("responses", {}).pop("422", None)
        schemas = doc.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        app.openapi_schema = doc
    return app.openapi_schema
