"""The server's own /openapi.json is a contract: schemathesis generates requests from it (valid
and invalid) against a real `inferd serve` (inferd-tiny + the example repository) and checks
every answer against the document: the status is documented, the content type and body match
the schema, a request outside the schema is refused with a 4xx, and nothing is a 5xx except a
503 for a request whose own `timeout` passed (documented).

Bounded: a fixed seed, derandomized, no shrinking; per operation the coverage phase (each
boundary, missing or wrong-typed field once) and MAX_EXAMPLES generated cases.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import hypothesis.strategies as st
import pytest
import schemathesis
from conftest import Server, start_server, stop_server
from fastapi.routing import APIRoute
from schemathesis.core.jsonschema.types import JsonValue

from inferd.config import ServerConfig
from inferd.examples import ensure_example_repository
from inferd.gateway import create_app

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MAX_EXAMPLES = 25
# Where acceptance depends on the model and not only on the schema (input names and shapes, the
# context window, the vocabulary, an image model's sizes, steps and `n`), a body the schema allows
# may get its documented 400.
MODEL_DEPENDENT = (
    r"(/infer|/v1/completions|/v1/chat/completions|/v1/embeddings|/v1/images/generations)$"
)
CONFIG = schemathesis.Config.from_dict(
    {
        "seed": 20261122,
        "generation": {
            "mode": "all",
            "max-examples": MAX_EXAMPLES,
            "deterministic": True,
            "no-shrink": True,
            "database": "none",
        },
        "phases": {"stateful": {"enabled": False}},
        "request-timeout": 60,
        # Replaced by `only_deadline_503`.
        "checks": {"not_a_server_error": {"enabled": False}},
        "operations": [
            {
                "include-path-regex": MODEL_DEPENDENT,
                "checks": {"positive_data_acceptance": {"enabled": False}},
            },
            # Inference bodies are read only for a served model (an unknown one is a 404 first).
            {"include-path-regex": "/infer$", "parameters": {"model": "fraud", "version": "1"}},
        ],
    }
)
REAL_MODELS = ("fraud", "image", "minilm")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    repo = ensure_example_repository()
    extra = ("inferd-tiny", "--model-repository", str(repo), "--grpc-port", "-1")
    # A short context keeps every generated completion short (n up to 16 choices).
    s = start_server(
        tmp_path_factory.mktemp("contract"), *extra, "--max-model-len", "64", timeout_s=300
    )
    yield s
    stop_server(s)


def document() -> dict[str, Any]:
    """The document the server serves (test_served_document_is_this_one checks it is)."""
    return create_app(None, ServerConfig(access_log=False)).openapi()


schema = schemathesis.openapi.from_dict(document(), config=CONFIG)


@schema.hook
def flatmap_path_parameters(
    context: schemathesis.HookContext, path_parameters: dict[str, Any] | None
) -> st.SearchStrategy[dict[str, Any] | None]:
    # Half the cases name a served model (and version 1), so routes are tested past their
    # 404. Not load/unload: unloading a model would take it from the later operations.
    op = context.operation
    if (
        not path_parameters
        or "model" not in path_parameters
        or (op is not None and "/repository/" in op.path)
    ):
        return st.just(path_parameters)
    real = st.sampled_from(REAL_MODELS).map(lambda m: {**path_parameters, "model": m})
    if "version" in path_parameters:
        real = real.map(lambda p: {**p, "version": "1"})
    return st.one_of(st.just(path_parameters), real)


# The model a body may name: the LLM on /v1/completions and chat, an embedding model on
# /v1/embeddings.
BODY_MODELS = {"/v1/embeddings": "minilm"}


@schema.hook
def flatmap_body(context: schemathesis.HookContext, body: Any) -> st.SearchStrategy[Any]:
    # Half the bodies that name a model (a string) name the served one, so they are tested past
    # their 404; an invalid body stays invalid (the model is not what made it so).
    op = context.operation
    if op is None or not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return st.just(body)
    served = BODY_MODELS.get(op.path, "inferd-tiny")
    return st.one_of(st.just(body), st.just({**body, "model": served}))


def only_deadline_503(
    ctx: Any, response: schemathesis.Response, case: schemathesis.Case[Any]
) -> None:
    """No 5xx, except the documented 503 of a request whose own timeout passed while queued."""
    if response.status_code < 500:
        return
    assert response.status_code == 503 and _has_timeout(case), (
        f"{response.status_code} {response.text[:500]}"
    )
    error = json.loads(response.text)["error"]
    message = error if isinstance(error, str) else error["code"] + " " + error["message"]
    assert "timeout" in message, message


def _has_timeout(case: schemathesis.Case[Any]) -> bool:
    body = case.body if isinstance(case.body, dict) else {}
    params = body.get("parameters")
    kserve = params.get("timeout") if isinstance(params, dict) else None
    return body.get("timeout") is not None or bool(kserve)


def test_served_document_is_this_one(server: Server) -> None:
    served = httpx.get(server.url + "/openapi.json", timeout=30).json()
    assert served == document()


@schema.parametrize()
def test_api_conforms_to_openapi(case: schemathesis.Case[Any], server: Server) -> None:
    case.call_and_validate(base_url=server.url, additional_checks=[only_deadline_503])


FRAUD_ROW: dict[str, JsonValue] = {
    "name": "features",
    "shape": [1, 8],
    "datatype": "FP32",
    "data": [0.0] * 8,
}


@pytest.mark.parametrize("binary", [False, True])
def test_inference_conforms(server: Server, binary: bool) -> None:
    """A request the generated cases cannot write (the model's own input): 200, as JSON or
    with the outputs as raw bytes after the JSON (`application/octet-stream`)."""
    infer = schema["/v2/models/{model}/infer"]["POST"]
    body: JsonValue = {"inputs": [FRAUD_ROW], "parameters": {"binary_data_output": binary}}
    case = infer.Case(path_parameters={"model": "fraud"}, body=body, media_type="application/json")
    response = case.call_and_validate(base_url=server.url)
    assert response.status_code == 200
    expected = "application/octet-stream" if binary else "application/json"
    assert response.headers["content-type"][0].startswith(expected)


def test_repository_load_and_unload_conform(server: Server) -> None:
    """The repository API on a real model (the generated cases use unknown names): unload, then
    infer gets the documented 503, then load serves it again."""
    unload = schema["/v2/repository/models/{model}/unload"]["POST"]
    load = schema["/v2/repository/models/{model}/load"]["POST"]
    infer = schema["/v2/models/{model}/infer"]["POST"]
    infer_case = infer.Case(
        path_parameters={"model": "fraud"},
        body={"inputs": [FRAUD_ROW]},
        media_type="application/json",
    )

    url = server.url
    unload.Case(path_parameters={"model": "fraud"}, body={}).call_and_validate(base_url=url)
    gone = infer_case.call_and_validate(base_url=url)
    assert gone.status_code == 503
    load.Case(path_parameters={"model": "fraud"}, body={}).call_and_validate(base_url=url)
    back = infer_case.call_and_validate(base_url=url)
    assert back.status_code == 200


def test_document_declares_every_route() -> None:
    """Every HTTP route the app answers is in the document, with its path parameters."""
    doc = document()
    paths = set(doc["paths"])
    app_routes = _app_routes()
    assert app_routes <= paths, app_routes - paths
    for path, ops in doc["paths"].items():
        for op in ops.values():
            declared = {p["name"] for p in op.get("parameters", ()) if p["in"] == "path"}
            assert declared == set(_placeholders(path)), (path, declared)
            assert "422" not in op["responses"], path


def _placeholders(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{")]


def _app_routes() -> set[str]:
    app = create_app(None, ServerConfig(access_log=False))
    return {
        route.path
        for route in app.routes
        if isinstance(route, APIRoute)  # not the docs' own routes, not WebSockets
    }
