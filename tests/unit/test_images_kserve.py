"""Image models on KServe v2 against a faked image engine: tritonclient's own request bodies over
HTTP (JSON and the binary extension), a real gRPC server with tritonclient.grpc, the model
index, metadata, ready and config, and the protocol's errors."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from fake_image_engine import fake_pixels
from fastapi.testclient import TestClient
from test_images_gateway import make
from tritonclient.utils import InferenceServerException

from inferd.diffusion.request import ImageParams
from inferd.gateway.kserve.grpc_server import start_grpc_server, stop_grpc_server

INFER = "/v2/models/tiny-sd/infer"


def _inputs(module: Any, prompt: str, **ints: int) -> list[Any]:
    tensor = module.InferInput("prompt", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    out = [tensor]
    for name, value in ints.items():
        t = module.InferInput(name, [1], "INT64")
        t.set_data_from_numpy(np.array([value], dtype=np.int64))
        out.append(t)
    return out


def _post(client: TestClient, inputs: list[Any], binary: bool, model: str = "tiny-sd") -> Any:
    outputs = [triton_http.InferRequestedOutput("image", binary_data=binary)]
    body, header_length = triton_http.InferenceServerClient.generate_request_body(
        inputs, outputs=outputs
    )
    headers = (
        {} if header_length is None else {"Inference-Header-Content-Length": str(header_length)}
    )
    r = client.post(f"/v2/models/{model}/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    length = r.headers.get("inference-header-content-length")
    return triton_http.InferenceServerClient.parse_response_body(
        r.content, header_length=None if length is None else int(length)
    )


@pytest.mark.parametrize("binary", [False, True])
def test_http_infer_returns_uint8_pixels(binary: bool) -> None:
    client, engine = make()
    result = _post(client, _inputs(triton_http, "a fox", n=2, width=24, height=16, seed=9), binary)
    image = result.as_numpy("image")
    want = fake_pixels(ImageParams("a fox", n=2), 9, 24, 16)
    assert image.dtype == np.uint8
    np.testing.assert_array_equal(image, want)
    response = result.get_response()
    assert response["parameters"]["seed"] == 9
    assert "denoise" in response["parameters"]["timings"]
    p = engine.seen[0].params
    assert (p.n, p.width, p.height, p.lora_name) == (2, 24, 16, None)


def test_a_style_is_served_under_its_own_name() -> None:
    client, engine = make()
    _post(client, _inputs(triton_http, "a fox"), True, model="ink")
    assert engine.seen[0].params.lora_name == "ink"


def test_kserve_requests_join_the_image_metrics_only() -> None:
    client, _ = make()
    _post(client, _inputs(triton_http, "a fox"), True)
    text = client.get("/metrics").text
    assert 'inferd_image_requests_total{model="tiny-sd",outcome="ok"} 1.0' in text
    assert 'inferd_model_receive_seconds_count{model="tiny-sd"}' not in text


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ([{"name": "steps", "datatype": "INT64", "shape": [1], "data": [2]}], "prompt"),
        ([{"name": "colour", "datatype": "INT64", "shape": [1], "data": [2]}], "unknown input"),
        ([{"name": "prompt", "datatype": "INT64", "shape": [1], "data": [2]}], "BYTES"),
        ([{"name": "prompt", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]}], "one value"),
    ],
)
def test_bad_inputs_are_400_in_kserve_form(inputs: list[Any], message: str) -> None:
    client, engine = make()
    r = client.post(INFER, json={"inputs": inputs})
    assert r.status_code == 400 and message in r.json()["error"]
    assert not engine.seen


def test_the_engine_limits_are_400_and_a_full_queue_429() -> None:
    client, engine = make()
    prompt = {"name": "prompt", "datatype": "BYTES", "shape": [1], "data": ["x"]}
    steps = {"name": "steps", "datatype": "INT64", "shape": [1], "data": [999]}
    r = client.post(INFER, json={"inputs": [prompt, steps]})
    assert r.status_code == 400 and "steps" in r.json()["error"]
    engine.queue_full = True
    r = client.post(INFER, json={"inputs": [prompt], "parameters": {"steps": 2}})
    assert r.status_code == 429 and "retry-after" in r.headers


def test_index_metadata_ready_and_config_know_the_image_model() -> None:
    client, _ = make()
    index = client.post("/v2/repository/index", json={}).json()
    assert {e["name"]: e["state"] for e in index} == {"ink": "READY", "tiny-sd": "READY"}
    assert client.get("/v2/models").json()["models"] == ["ink", "tiny-sd"]
    meta = client.get("/v2/models/tiny-sd").json()
    assert meta["platform"] == "inferd_diffusion"
    assert meta["outputs"] == [{"name": "image", "datatype": "UINT8", "shape": [-1, -1, -1, 3]}]
    assert client.get("/v2/models/tiny-sd/ready").json()["ready"] is True
    config = client.get("/v2/models/ink/config").json()
    assert config["parameters"]["base_model"] == "tiny-sd"
    assert client.get("/v2/models/tiny-sd/versions/2").status_code == 404
    assert client.get("/v2/models/nope").status_code == 404


# -- gRPC --------------------------------------------------------------------------------------


@pytest.fixture
def grpc_client() -> Iterator[tuple[triton_grpc.InferenceServerClient, Any]]:
    client, engine = make()
    state = client.app.state.gateway  # type: ignore[attr-defined]
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(
        start_grpc_server(state, "127.0.0.1", 0), loop
    ).result(30)
    triton = triton_grpc.InferenceServerClient(f"127.0.0.1:{server.port}")
    try:
        yield triton, engine
    finally:
        triton.close()
        asyncio.run_coroutine_threadsafe(stop_grpc_server(server, grace_s=1.0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_grpc_infer_and_metadata(grpc_client: tuple[Any, Any]) -> None:
    triton, _ = grpc_client
    assert triton.is_model_ready("tiny-sd") and not triton.is_model_ready("nope")
    assert triton.get_model_metadata("tiny-sd", as_json=True)["platform"] == "inferd_diffusion"
    result = triton.infer("tiny-sd", _inputs(triton_grpc, "a fox", seed=4, width=16))
    want = fake_pixels(ImageParams("a fox"), 4, 16, 32)
    np.testing.assert_array_equal(result.as_numpy("image"), want)
    names = [m["name"] for m in triton.get_model_repository_index(as_json=True)["models"]]
    assert names == ["ink", "tiny-sd"]


def test_grpc_errors_are_invalid_argument(grpc_client: tuple[Any, Any]) -> None:
    triton, _ = grpc_client
    with pytest.raises(InferenceServerException) as e:
        triton.infer("tiny-sd", _inputs(triton_grpc, "a fox", width=30))
    assert "INVALID_ARGUMENT" in str(e.value.status())
