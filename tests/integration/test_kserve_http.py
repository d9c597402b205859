"""The Open Inference Protocol over HTTP: tritonclient.http and httpx against a real uvicorn
serving a real model repository (ONNX Runtime and python-backend models built in the test)."""

from __future__ import annotations

import asyncio
import gzip
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as triton
from kserve_server import (
    LABELS,
    LiveServer,
    serve,
    softmax_reference,
    write_repository,
)
from tritonclient.utils import InferenceServerException

from inferd.config import ServerConfig
from inferd.gateway import create_app
from inferd.gateway.kserve import http as kserve_http

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

X = np.array([[1.0, 2.0, 3.0, 4.0], [0.5, -1.0, 0.0, 2.0]], dtype=np.float32)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = write_repository(tmp_path_factory.mktemp("repo"))
    with serve(root) as live:
        yield live


@pytest.fixture
def client(server: LiveServer) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(server.host, network_timeout=30)
    yield c
    c.close()


def infer_input(name: str, array: np.ndarray, binary: bool = True) -> triton.InferInput:
    datatype = "BYTES" if array.dtype == object else triton.np_to_triton_dtype(array.dtype)
    inp = triton.InferInput(name, list(array.shape), datatype)
    inp.set_data_from_numpy(array, binary_data=binary)
    return inp


def as_bytes(items: np.ndarray) -> list[bytes]:
    """tritonclient returns JSON BYTES as str and binary BYTES as bytes (as with Triton)."""
    return [v.encode() if isinstance(v, str) else bytes(v) for v in items.reshape(-1)]


def post(server: LiveServer, path: str, body: bytes, **headers: str) -> httpx.Response:
    return httpx.post(server.url + path, content=body, headers=headers, timeout=30)


def assert_kserve_error(r: httpx.Response, status: int, *words: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert list(body) == ["error"] and isinstance(body["error"], str)
    for word in words:
        assert word in body["error"], body["error"]
    return str(body["error"])


# -- metadata, readiness, config ---------------------------------------------------------------


def test_server_metadata_and_health(client: triton.InferenceServerClient) -> None:
    meta = client.get_server_metadata()
    assert meta["name"] == "inferd"
    assert {"binary_tensor_data", "classification", "model_repository"} <= set(meta["extensions"])
    assert client.is_server_live() and client.is_server_ready()


def test_model_metadata_config_and_ready(client: triton.InferenceServerClient) -> None:
    meta = client.get_model_metadata("classifier")
    assert meta["platform"] == "onnxruntime_onnx" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert meta["outputs"] == [{"name": "probs", "datatype": "FP32", "shape": [-1, 3]}]
    assert client.get_model_metadata("classifier", "1")["name"] == "classifier"
    config = client.get_model_config("classifier")
    assert config["max_batch_size"] == 8
    assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}]
    assert client.is_model_ready("classifier") and client.is_model_ready("classifier", "1")
    assert not client.is_model_ready("classifier", "9")
    assert not client.is_model_ready("nope")


def test_model_list_and_not_found_errors(server: LiveServer) -> None:
    models = httpx.get(server.url + "/v2/models").json()["models"]
    assert {"classifier", "echo", "embedder", "slow"} <= set(models)
    ready = httpx.get(server.url + "/v2/models/classifier/ready")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    assert_kserve_error(httpx.get(server.url + "/v2/models/nope"), 404, "nope")
    assert_kserve_error(httpx.get(server.url + "/v2/models/classifier/versions/7/config"), 404)
    assert_kserve_error(httpx.get(server.url + "/v2/no/such/route"), 404)


# -- inference ---------------------------------------------------------------------------------


@pytest.mark.parametrize("binary", [True, False])
def test_infer_binary_and_json(client: triton.InferenceServerClient, binary: bool) -> None:
    out = triton.InferRequestedOutput("probs", binary_data=binary)
    result = client.infer(
        "classifier", [infer_input("x", X, binary)], outputs=[out], request_id="req-7"
    )
    np.testing.assert_allclose(result.as_numpy("probs"), softmax_reference(X), rtol=1e-5)
    response = result.get_response()
    assert response["id"] == "req-7" and response["model_version"] == "1"
    assert ("parameters" in response["outputs"][0]) is binary
    timings = response["parameters"]["timings"]
    for stage in ("receive", "queue", "infer", "stream"):
        assert timings[stage] >= 0.0


def test_infer_default_outputs_come_back_binary(client: triton.InferenceServerClient) -> None:
    result = client.infer("classifier", [infer_input("x", X)], priority=0, timeout=10_000_000)
    assert result.get_output("probs")["parameters"]["binary_data_size"] == X.shape[0] * 3 * 4
    np.testing.assert_allclose(result.as_numpy("probs"), softmax_reference(X), rtol=1e-5)


@pytest.mark.parametrize("binary", [True, False])
def test_classification_output(client: triton.InferenceServerClient, binary: bool) -> None:
    out = triton.InferRequestedOutput("probs", binary_data=binary, class_count=2)
    result = client.infer("classifier", [infer_input("x", X)], outputs=[out])
    got = result.as_numpy("probs")
    assert got.shape == (2, 2)
    expected = softmax_reference(X)
    for row, probs in zip(got, expected, strict=True):
        top = np.argsort(-probs)[:2]
        parsed = [item.decode().split(":") for item in as_bytes(row)]
        assert [int(p[1]) for p in parsed] == top.tolist()
        assert [p[2] for p in parsed] == [LABELS[i] for i in top]
        np.testing.assert_allclose([float(p[0]) for p in parsed], probs[top], atol=1e-5)


@pytest.mark.parametrize("binary", [True, False])
def test_bytes_tensors(client: triton.InferenceServerClient, binary: bool) -> None:
    text = np.array([["héllo wörld".encode()], [b""], [b"abc"]], dtype=object)
    outputs = [
        triton.InferRequestedOutput("upper", binary_data=binary),
        triton.InferRequestedOutput("length", binary_data=binary),
    ]
    result = client.infer("echo", [infer_input("text", text, binary)], outputs=outputs)
    assert as_bytes(result.as_numpy("upper")) == ["HéLLO WöRLD".encode(), b"", b"ABC"]
    assert result.as_numpy("length").reshape(-1).tolist() == [13, 0, 3]


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_request_and_response(
    client: triton.InferenceServerClient, algorithm: str
) -> None:
    text = np.array([[f"row {i} ".encode() * 40] for i in range(8)], dtype=object)
    result = client.infer(
        "echo",
        [infer_input("text", text)],
        request_compression_algorithm=algorithm,
        response_compression_algorithm=algorithm,
    )
    assert result.as_numpy("upper").reshape(-1).tolist() == [t.upper() for t in text.reshape(-1)]


def test_response_compression_header(server: LiveServer) -> None:
    body = orjson.dumps(
        {
            "inputs": [
                {"name": "text", "shape": [4, 1], "datatype": "BYTES", "data": ["x" * 500] * 4}
            ]
        }
    )
    r = post(server, "/v2/models/echo/infer", gzip.compress(body), **{"Content-Encoding": "gzip"})
    assert r.status_code == 200 and r.headers["content-encoding"] == "gzip"
    assert r.json()["outputs"][0]["data"] == ["X" * 500] * 4  # httpx inflated it


def test_raw_binary_request(server: LiveServer) -> None:
    row = X[:1]
    r = post(
        server,
        "/v2/models/classifier/infer",
        row.tobytes(),
        **{"Inference-Header-Content-Length": "0"},
    )
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    size = int(r.headers["inference-header-content-length"])
    result = triton.InferResult.from_response_body(r.content, header_length=size)
    np.testing.assert_allclose(result.as_numpy("probs"), softmax_reference(row), rtol=1e-5)


# -- malformed requests: always 400 with {"error": ...} ----------------------------------------


def json_request(*inputs: dict[str, Any], **extra: Any) -> bytes:
    return orjson.dumps({"inputs": list(inputs), **extra})


def x_input(**kw: Any) -> dict[str, Any]:
    return {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4], **kw}


BAD_REQUESTS = [
    ("wrong shape", json_request(x_input(shape=[1, 5])), {}, "needs 5 elements"),
    ("shape vs model", json_request(x_input(shape=[4, 1])), {}, "x"),
    ("wrong datatype", json_request(x_input(datatype="INT32")), {}, "x"),
    ("unknown datatype", json_request(x_input(datatype="FLOAT32")), {}, "unknown datatype"),
    ("unknown input", json_request(x_input(), x_input(name="z")), {}, "z"),
    ("missing input", json_request(x_input(name="z")), {}, "x"),
    ("too many rows", json_request(x_input(shape=[9, 4], data=[0.0] * 36)), {}, ""),
    ("unknown output", json_request(x_input(), outputs=[{"name": "nope"}]), {}, "nope"),
    ("invalid JSON", b'{"inputs": [', {}, "JSON"),
    ("invalid UTF-8", b'{"inputs": "\xff\xfe"}', {}, "JSON"),
    ("negative dim", json_request(x_input(shape=[-1, 4])), {}, "negative"),
    ("bad header length", json_request(x_input()), {"Inference-Header-Content-Length": "x"}, ""),
    ("header too long", json_request(x_input()), {"Inference-Header-Content-Length": "9999"}, ""),
    ("bad gzip", b"not gzip", {"Content-Encoding": "gzip"}, "gzip"),
    ("bad priority", json_request(x_input(), parameters={"priority": -1}), {}, "priority"),
]


@pytest.mark.parametrize(
    ("body", "headers", "word"), [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS]
)
def test_malformed_requests_are_400(
    server: LiveServer, body: bytes, headers: dict[str, str], word: str
) -> None:
    assert_kserve_error(post(server, "/v2/models/classifier/infer", body, **headers), 400, word)


def binary_x(claimed: int, payload: bytes) -> tuple[bytes, str]:
    header = json_request(
        {
            "name": "x",
            "shape": [1, 4],
            "datatype": "FP32",
            "parameters": {"binary_data_size": claimed},
        }
    )
    return header + payload, str(len(header))


@pytest.mark.parametrize(
    ("claimed", "payload", "word"),
    [
        (16, b"\x00" * 8, "only 8 bytes"),
        (8, b"\x00" * 8, "expected 16 bytes"),
        (16, b"\x00" * 24, "not claimed"),
    ],
)
def test_malformed_binary_payloads_are_400(
    server: LiveServer, claimed: int, payload: bytes, word: str
) -> None:
    body, size = binary_x(claimed, payload)
    r = post(
        server, "/v2/models/classifier/infer", body, **{"Inference-Header-Content-Length": size}
    )
    assert_kserve_error(r, 400, word)


def test_bad_bytes_element_length_is_400(server: LiveServer) -> None:
    params = {"binary_data_size": 8}
    header = json_request(
        {"name": "text", "shape": [1, 1], "datatype": "BYTES", "parameters": params}
    )
    body = header + struct.pack("<I", 1000) + b"abcd"
    r = post(
        server,
        "/v2/models/echo/infer",
        body,
        **{"Inference-Header-Content-Length": str(len(header))},
    )
    assert_kserve_error(r, 400, "past the end")


def test_tritonclient_sees_400_for_a_wrong_datatype(client: triton.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as info:
        client.infer("classifier", [infer_input("x", X.astype(np.float64))])
    assert info.value.status() == "400"
    assert "x" in info.value.message()


def test_statistics_extension(client: triton.InferenceServerClient) -> None:
    before = client.get_inference_statistics("classifier")["model_stats"][0]
    x = np.zeros((3, 4), dtype=np.float32)
    inp = triton.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    client.infer("classifier", [inp])
    (after,) = client.get_inference_statistics("classifier")["model_stats"]
    assert after["name"] == "classifier"
    success = after["inference_stats"]["success"]
    assert success["count"] == before["inference_stats"]["success"]["count"] + 1
    assert success["ns"] > before["inference_stats"]["success"]["ns"]
    assert after["inference_count"] == before["inference_count"] + 3
    assert after["execution_count"] >= before["execution_count"] + 1
    everything = client.get_inference_statistics()["model_stats"]
    assert "classifier" in {m["name"] for m in everything}
    with pytest.raises(InferenceServerException):
        client.get_inference_statistics("no-such-model")


def test_unknown_model_and_version_are_404(client: triton.InferenceServerClient) -> None:
    for model, version in (("nope", ""), ("classifier", "3")):
        with pytest.raises(InferenceServerException) as info:
            client.infer(model, [infer_input("x", X)], model_version=version)
        assert info.value.status() == "404"


# -- admission: 429 queue full, 503 queue timeout and draining --------------------------------


def test_queue_full_is_429_and_queue_timeout_is_503(server: LiveServer) -> None:
    """`slow` runs one request at a time for SLOW_S and queues at most one more."""
    one = json_request({"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1.5]})
    short = json_request(
        {"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1.5]},
        parameters={"timeout": 1000},  # microseconds
    )
    served = server.state.repository.get("slow")  # type: ignore[union-attr]

    async def run() -> tuple[httpx.Response, httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            url = "/v2/models/slow/infer"
            first = asyncio.create_task(c.post(url, content=one))
            while served.inflight < 1:  # admitted: it runs at once, the instance is free
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.02)
            # Queued behind `first`; its 1 ms deadline passes long before `first` ends.
            timed_out = await c.post(url, content=short)
            # One of these may run or queue, but three cannot all fit in one queue slot.
            burst = await asyncio.gather(*(c.post(url, content=one) for _ in range(3)))
            return await first, timed_out, list(burst)

    # The short request must reach the queue while `first` runs; on a loaded machine it can
    # arrive after `first` finished and run at once (200). That is the setup missing, not the
    # behaviour under test, so the scenario is tried again (at most three times).
    for _ in range(3):
        first, timed_out, burst = asyncio.run(run())
        if timed_out.status_code != 200:
            break
    assert first.status_code == 200 and first.json()["outputs"][0]["data"] == [3.0]
    assert_kserve_error(timed_out, 503)
    statuses = sorted(r.status_code for r in burst)
    assert 429 in statuses and set(statuses) <= {200, 429}
    full = next(r for r in burst if r.status_code == 429)
    assert_kserve_error(full, 429, "slow")
    assert int(full.headers["retry-after"]) >= 1


def test_draining_is_503(server: LiveServer) -> None:
    server.state.draining = True
    try:
        r = post(server, "/v2/models/classifier/infer", json_request(x_input()))
        assert_kserve_error(r, 503, "shutting down")
        assert httpx.get(server.url + "/v2/models/classifier/ready").status_code == 400
    finally:
        server.state.draining = False


# -- model repository --------------------------------------------------------------------------


def test_repository_index_unload_and_load(client: triton.InferenceServerClient) -> None:
    index = {(e["name"], e["state"]) for e in client.get_model_repository_index()}
    assert ("echo", "READY") in index
    client.unload_model("echo")
    try:
        assert not client.is_model_ready("echo")
        states = {e["name"]: e["state"] for e in client.get_model_repository_index()}
        assert states["echo"] == "UNAVAILABLE"
        with pytest.raises(InferenceServerException) as info:
            client.infer("echo", [infer_input("text", np.array([[b"a"]], dtype=object))])
        assert info.value.status() == "503"
    finally:
        client.load_model("echo")
    assert client.is_model_ready("echo")
    result = client.infer("echo", [infer_input("text", np.array([[b"a"]], dtype=object))])
    assert result.as_numpy("upper").tolist() == [[b"A"]]


def test_repository_index_ready_filter_and_errors(server: LiveServer) -> None:
    ready = post(server, "/v2/repository/index", orjson.dumps({"ready": True})).json()
    assert all(e["state"] == "READY" for e in ready) and ready
    assert_kserve_error(post(server, "/v2/repository/index", b"{oops"), 400, "JSON")
    assert_kserve_error(post(server, "/v2/repository/models/nope/load", b""), 404, "nope")
    inline = orjson.dumps({"parameters": {"config": "{}"}})
    assert_kserve_error(post(server, "/v2/repository/models/echo/load", inline), 400, "config")


def metric(server: LiveServer, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rpartition(" ")[2])
    return 0.0


def test_gateway_stages_reach_the_model_histograms(
    server: LiveServer, client: triton.InferenceServerClient
) -> None:
    names = [
        f'inferd_model_{stage}_seconds_count{{model="echo"}}'
        for stage in ("receive", "infer", "stream")
    ]
    before = [metric(server, n) for n in names]
    client.infer("echo", [infer_input("text", np.array([[b"a"]], dtype=object))])
    # `stream` is observed once the response was sent: allow the server a moment for it.
    deadline = time.monotonic() + 5
    while metric(server, names[-1]) == before[-1] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [metric(server, n) for n in names] == [b + 1 for b in before]


def test_errors_are_counted_as_rejections(server: LiveServer) -> None:
    name = 'inferd_requests_rejected_total{reason="invalid"}'
    before = metric(server, name)
    post(server, "/v2/models/classifier/infer", b"{")
    assert metric(server, name) == before + 1


# -- the app without a repository, and auth ----------------------------------------------------


def test_without_repository_and_with_api_keys() -> None:
    app = create_app(None, ServerConfig(access_log=False, api_keys=("k1",)))
    app.state.gateway.serves_llm = False

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            auth = {"Authorization": "Bearer k1"}
            return [
                await c.get("/v2/models/m"),
                await c.get("/v2/models/m", headers=auth),
                await c.get("/v2/models", headers=auth),
                await c.post("/v1/embeddings", json={"model": "m", "input": "a"}),
                await c.get("/v2/health/ready"),
                await c.post("/v2/models/m/infer", content=b"{}"),
                await c.post("/v2/models/m/versions/2/infer", content=b"{}", headers=auth),
                await c.get("/v2/models/m/infer", headers=auth),
            ]

    unauthorized, missing, listed, openai_401, ready, *infer = asyncio.run(run())
    assert_kserve_error(unauthorized, 401, "API key")
    assert_kserve_error(missing, 404, "--model-repository")
    assert listed.json() == {"models": []}
    assert (
        openai_401.status_code == 401
        and openai_401.json()["error"]["type"] == "authentication_error"
    )
    assert ready.status_code == 200
    infer_401, infer_404, infer_get = infer
    assert_kserve_error(infer_401, 401, "API key")
    assert_kserve_error(infer_404, 404, "--model-repository")
    assert infer_get.status_code == 405
    assert infer_401.headers["x-request-id"] and infer_404.headers["x-request-id"]


@pytest.mark.parametrize(
    ("method", "path", "root", "params"),
    [
        ("POST", "/v2/models/m/infer", "", {"model": "m"}),
        ("POST", "/v2/models/m/versions/3/infer", "", {"model": "m", "version": "3"}),
        ("POST", "/api/v2/models/m/infer", "/api", {"model": "m"}),
        ("GET", "/v2/models/m/infer", "", None),
        ("POST", "/v2/models/m/infer/", "", None),
        ("POST", "/v2/models/a/b/infer", "", None),
        ("POST", "/v2/models/m/versions/3", "", None),
    ],
)
def test_infer_path_params_match_the_documented_routes(
    method: str, path: str, root: str, params: dict[str, str] | None
) -> None:
    scope = {"type": "http", "method": method, "path": path, "root_path": root}
    assert kserve_http.infer_path_params(scope) == params


def test_an_unexpected_error_in_infer_is_a_kserve_500(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inference runs ahead of the app's router (kserve_http.infer_front): a failure nobody
    expected still leaves as the app's 500, in KServe's error body."""
    app = create_app(None, ServerConfig(access_log=False))

    def broken(*_: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(kserve_http, "Catalog", broken)

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post("/v2/models/m/infer", content=b"{}")

    r = asyncio.run(run())
    assert_kserve_error(r, 500)


def test_empty_repository(tmp_path: Path) -> None:
    with serve(tmp_path) as live:
        assert post(live, "/v2/repository/index", b"").json() == []
        assert httpx.get(live.url + "/v2/health/ready").status_code == 200
