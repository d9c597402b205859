"""The image lane over its APIs against a real `inferd serve` with `inferd-tiny-sd`: the openai
client (base64, raw bytes, stream events), tritonclient over HTTP (binary) and gRPC, the errors,
a client that leaves, and what metrics and the request log say.

Every request asks for few steps on small images, so a request takes well under a second on a
CPU. Skips while the image engine (inferd.diffusion.tiny) is not part of the checkout.
"""

from __future__ import annotations

import base64
import io
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from conftest import Server, start_server, stop_server
from PIL import Image

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
pytest.importorskip("inferd.diffusion.tiny", reason="needs the image engine (inferd.diffusion)")

MODEL = "inferd-tiny-sd"
URL = "/v1/images/generations"
SIZE = 64
STEPS = 3
# A wait for the server to reach a state (never a measure of speed): bounded for a loaded box.
SETTLE_S = 120.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # One torch thread for the tiny UNet: two spin against each other on a shared CPU.
    extra = ("inferd-tiny", "--image-model", MODEL, "--image-threads", "1", "--grpc-port", "0")
    s = start_server(tmp_path_factory.mktemp("images"), *extra, timeout_s=300)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as c:
        yield c


def pixels(data: bytes) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def body(**extra: Any) -> dict[str, Any]:
    return {
        "prompt": "a red fox in the snow",
        "model": MODEL,
        "size": f"{SIZE}x{SIZE}",
        "num_inference_steps": STEPS,
        "seed": 11,
        **extra,
    }


def test_models_lists_the_llm_and_the_image_model(server: Server) -> None:
    data = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    by_id = {m["id"]: m for m in data}
    assert "inferd-tiny" in by_id and by_id[MODEL]["kind"] == "image"
    assert by_id[MODEL]["image_limits"]["size_multiple"] == 8


def test_openai_client_base64_is_reproducible(client: openai.OpenAI) -> None:
    extra = {"num_inference_steps": STEPS, "seed": 11}
    first = client.images.generate(
        prompt="a red fox in the snow", model=MODEL, size="64x64", n=2, extra_body=extra
    )
    assert first.size == "64x64" and first.output_format == "png"
    assert first.data is not None and len(first.data) == 2
    again = client.images.generate(
        prompt="a red fox in the snow", model=MODEL, size="64x64", n=1, extra_body=extra
    )
    assert again.data is not None
    a = pixels(base64.b64decode(first.data[0].b64_json or ""))
    b = pixels(base64.b64decode(again.data[0].b64_json or ""))
    assert a.shape == (SIZE, SIZE, 3)
    # The same seed draws the same first image, alone or with another (within rounding).
    assert np.abs(a.astype(int) - b.astype(int)).max() <= 3


def test_raw_bytes_and_formats(server: Server) -> None:
    png = httpx.post(f"{server.url}{URL}", json=body(), headers={"Accept": "image/png"}, timeout=60)
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    as_json = httpx.post(f"{server.url}{URL}", json=body(), timeout=60).json()
    assert pixels(base64.b64decode(as_json["data"][0]["b64_json"])).tolist() == (
        pixels(png.content).tolist()
    )
    assert {"denoise", "vae_decode", "image_encode", "e2e"} <= set(as_json["timings"])
    webp = httpx.post(
        f"{server.url}{URL}", json=body(response_format="file", output_format="webp"), timeout=60
    )
    assert webp.headers["content-type"] == "image/webp"
    assert Image.open(io.BytesIO(webp.content)).format == "WEBP"


def test_stream_events_parse_in_the_openai_client(client: openai.OpenAI) -> None:
    events = client.images.generate(
        prompt="a fox",
        model=MODEL,
        size="64x64",
        stream=True,
        partial_images=2,
        extra_body={"num_inference_steps": 6, "seed": 3},
    )
    kinds = [(e.type, getattr(e, "partial_image_index", None)) for e in events]
    assert kinds == [
        ("image_generation.partial_image", 0),
        ("image_generation.partial_image", 1),
        ("image_generation.completed", None),
    ]


@pytest.mark.parametrize(
    ("extra", "status", "param"),
    [
        ({"size": "60x64"}, 400, "size"),
        ({"size": "4096x4096"}, 400, "size"),
        ({"size": "large"}, 400, "size"),
        ({"num_inference_steps": 100_000}, 400, "num_inference_steps"),
        ({"n": 1000}, 400, "n"),
        ({"seed": "7"}, 400, "seed"),
        ({"response_format": "url"}, 400, "response_format"),
        ({"model": "no-such-style"}, 404, "model"),
    ],
)
def test_errors_are_openai_errors(
    server: Server, extra: dict[str, Any], status: int, param: str
) -> None:
    r = httpx.post(f"{server.url}{URL}", json=body(**extra), timeout=60)
    assert r.status_code == status, r.text
    assert (r.json()["error"]["param"] or "").startswith(param) or status == 404


def _triton_inputs(module: Any) -> list[Any]:
    prompt = module.InferInput("prompt", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([b"a red fox in the snow"], dtype=np.object_))
    out = [prompt]
    for name, value in {"steps": STEPS, "seed": 11, "width": SIZE, "height": SIZE}.items():
        t = module.InferInput(name, [1], "INT64")
        t.set_data_from_numpy(np.array([value], dtype=np.int64))
        out.append(t)
    return out


def test_tritonclient_http_and_grpc_return_the_same_pixels(server: Server) -> None:
    png = httpx.post(f"{server.url}{URL}", json=body(), headers={"Accept": "image/png"}, timeout=60)
    http = triton_http.InferenceServerClient(f"127.0.0.1:{server.port}", connection_timeout=60)
    assert http.is_model_ready(MODEL)
    assert http.get_model_metadata(MODEL)["outputs"][0]["datatype"] == "UINT8"
    requested = [triton_http.InferRequestedOutput("image", binary_data=True)]
    image = http.infer(MODEL, _triton_inputs(triton_http), outputs=requested).as_numpy("image")
    assert image.shape == (1, SIZE, SIZE, 3) and image.dtype == np.uint8
    np.testing.assert_array_equal(image[0], pixels(png.content))
    found = re.search(rb"ready: .* gRPC :(\d+)", server.log.read_bytes())
    assert found is not None, server.log.read_text()
    grpc = triton_grpc.InferenceServerClient(f"127.0.0.1:{int(found.group(1))}")
    try:
        same = grpc.infer(MODEL, _triton_inputs(triton_grpc)).as_numpy("image")
    finally:
        grpc.close()
    np.testing.assert_array_equal(same, image)


def _metric(server: Server, name: str) -> float:
    return server.metrics().get(f'{name}{{model="{MODEL}"}}', 0.0)


def test_a_client_that_leaves_aborts_its_request(server: Server) -> None:
    aborted = 'inferd_image_requests_total{model="inferd-tiny-sd",outcome="abort"}'
    before = server.metrics().get(aborted, 0.0)
    long = body(num_inference_steps=150, stream=True, size="128x128")
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{server.url}{URL}", json=long) as r:
        assert r.status_code == 200  # the headers: the request is admitted and denoising
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        if (
            server.metrics().get(aborted, 0.0) > before
            and _metric(server, "inferd_image_requests_running") == 0
        ):
            return
        time.sleep(0.2)
    pytest.fail("the abandoned request was not aborted in the engine")


def test_metrics_and_the_request_log_see_each_stage(server: Server) -> None:
    r = httpx.post(f"{server.url}{URL}", json=body(n=2), timeout=60)
    assert r.status_code == 200
    for stage in ("text_encode", "queue", "denoise", "vae_decode", "image_encode"):
        assert _metric(server, f"inferd_image_{stage}_seconds_count") >= 1, stage
    forwards = _metric(server, "inferd_image_unet_forwards_total")
    assert forwards >= STEPS and _metric(server, "inferd_image_unet_rows_total") >= forwards
    record = httpx.get(f"{server.url}/v1/requests/{r.headers['x-request-id']}", timeout=30).json()
    assert record["lane"] == "image" and record["images"] == 2
    assert len(record["token_ticks"]) == STEPS  # a tick per denoising step
    assert sum(p["seconds"] for p in record["path"]) == pytest.approx(record["e2e"], abs=1e-4)


def test_websocket_progress_and_binary_image_frames(server: Server) -> None:
    import asyncio
    import json

    import websockets

    url = server.url.replace("http", "ws") + URL + "/ws"

    async def run() -> list[Any]:
        out: list[Any] = []
        async with websockets.connect(url, max_size=None) as ws:
            await ws.send(json.dumps(body(partial_images=1, num_inference_steps=4)))
            while (frame := await ws.recv()) != "[DONE]":
                out.append(frame if isinstance(frame, bytes) else json.loads(frame))
        return out

    frames = asyncio.run(run())
    steps = [f["step"] for f in frames if isinstance(f, dict) and f["type"] == "progress"]
    assert steps == [1, 2, 3, 4]
    kinds = [f["type"] for f in frames if isinstance(f, dict)]
    assert kinds.count("partial_image") == 1 and kinds[-2:] == ["image", "completed"]
    final = frames[-2]
    assert isinstance(final, bytes) and pixels(final).shape == (SIZE, SIZE, 3)
    assert frames[-1]["seed"] == 11
