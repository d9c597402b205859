"""The image lane's OpenAI API in-process against a faked image engine: shapes, the binary
path, streaming, errors, /v1/models, metrics and the request log."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_image_engine import FakeImageEngine, fake_pixels
from fastapi.testclient import TestClient
from PIL import Image

from inferd.config import ServerConfig
from inferd.diffusion.request import ImageParams
from inferd.errors import InferdError
from inferd.gateway import create_app
from inferd.gateway.app import set_image_engines
from inferd.postprocess.image_encode import encode_image, encode_images
from inferd.telemetry.metrics import parse_samples
from inferd.telemetry.stages import Stage, StageTimings

URL = "/v1/images/generations"


def make(engine: FakeImageEngine | None = None) -> tuple[TestClient, FakeImageEngine]:
    fake = engine or FakeImageEngine("tiny-sd", styles=["ink"])
    app = create_app(None, ServerConfig(access_log=False))
    app.state.gateway.serves_llm = False
    set_image_engines(app, {fake.model_name: fake})
    return TestClient(app, raise_server_exceptions=False), fake


def decode(data: bytes) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def expected(prompt: str, seed: int, w: int = 32, h: int = 32, n: int = 1) -> Any:
    return fake_pixels(ImageParams(prompt, n=n), seed, w, h)


# -- image encoding ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp"])
def test_every_format_round_trips(fmt: Any) -> None:
    pixels = expected("a fox", 7, 24, 16, n=2)
    timings = StageTimings()
    files = encode_images(pixels, fmt, compression=10, timings=timings)
    assert len(files) == 2 and Stage.IMAGE_ENCODE in timings
    assert Image.open(io.BytesIO(files[0])).format == {"png": "PNG", "jpeg": "JPEG"}.get(
        fmt, "WEBP"
    )
    back = decode(files[1])
    assert back.shape == (16, 24, 3)
    if fmt == "png":  # lossless
        np.testing.assert_array_equal(back, pixels[1])


def test_compression_trades_size_for_quality() -> None:
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    assert len(encode_image(image, "jpeg", 90)) < len(encode_image(image, "jpeg", 5))


def test_encode_refuses_the_wrong_shape() -> None:
    with pytest.raises(ValueError, match="uint8"):
        encode_image(np.zeros((4, 4), np.uint8), "png")


# -- the JSON answer ---------------------------------------------------------------------------


def test_b64_json_answer_carries_the_images_and_timings() -> None:
    client, engine = make()
    r = client.post(URL, json={"prompt": "a fox", "n": 2, "size": "24x16", "seed": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["size"] == "24x16" and body["output_format"] == "png" and body["seed"] == 5
    assert len(body["data"]) == 2
    want = expected("a fox", 5, 24, 16, n=2)
    for i, item in enumerate(body["data"]):
        np.testing.assert_array_equal(decode(base64.b64decode(item["b64_json"])), want[i])
    stages = set(body["timings"])
    assert {"receive", "validate", "denoise", "vae_decode", "image_encode", "e2e"} <= stages
    params = engine.seen[0].params
    assert (params.width, params.height, params.n, params.seed) == (24, 16, 2, 5)


def test_extras_reach_the_engine() -> None:
    client, engine = make()
    body = {
        "prompt": "p",
        "negative_prompt": "blurry",
        "num_inference_steps": 3,
        "guidance_scale": 2,
        "model": "ink",
    }
    assert client.post(URL, json=body).status_code == 200
    p = engine.seen[0].params
    assert (p.negative_prompt, p.num_inference_steps, p.guidance_scale) == ("blurry", 3, 2.0)
    assert p.lora_name == "ink" and p.partial_images == 0


# -- raw bytes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "headers", "media_type"),
    [
        ({"response_format": "file"}, {}, "image/png"),
        ({"response_format": "file", "output_format": "webp"}, {}, "image/webp"),
        ({}, {"Accept": "image/jpeg"}, "image/jpeg"),
    ],
)
def test_raw_bytes(extra: dict[str, Any], headers: dict[str, str], media_type: str) -> None:
    client, _ = make()
    r = client.post(URL, json={"prompt": "a fox", "seed": 1, **extra}, headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == media_type
    assert decode(r.content).shape == (32, 32, 3)


def test_json_named_first_in_accept_wins() -> None:
    client, _ = make()
    r = client.post(URL, json={"prompt": "x"}, headers={"Accept": "application/json, image/png"})
    assert r.headers["content-type"] == "application/json" and r.json()["data"]


def test_raw_bytes_need_one_image() -> None:
    client, engine = make()
    r = client.post(URL, json={"prompt": "x", "n": 2, "response_format": "file"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert not engine.seen


# -- streaming -------------------------------------------------------------------------------------


def events(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_stream_sends_partials_then_the_image() -> None:
    client, _ = make()
    body = {"prompt": "a fox", "stream": True, "partial_images": 2, "num_inference_steps": 6}
    r = client.post(URL, json={**body, "seed": 3})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    got = events(r.text)
    kinds = [k for k, _ in got]
    assert kinds == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [d["partial_image_index"] for _, d in got[:2]] == [0, 1]
    assert all(d["type"] == k and d["size"] == "32x32" for k, d in got)
    final = got[-1][1]
    np.testing.assert_array_equal(
        decode(base64.b64decode(final["b64_json"])), expected("a fox", 3)[0]
    )
    assert "denoise" in final["timings"]


def test_stream_error_after_start_ends_with_an_error_event() -> None:
    client, engine = make()
    engine.fail = InferdError("the VAE failed")
    r = client.post(URL, json={"prompt": "x", "stream": True})
    kind, data = events(r.text)[-1]
    assert kind == "error" and data["error"]["message"] == "the VAE failed"


# -- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"size": "big"}, "size"),
        ({"size": "30x32"}, "size"),  # not a multiple of 8
        ({"size": "128x32"}, "size"),  # over the model's limit
        ({"num_inference_steps": 99}, "num_inference_steps"),
        ({"num_inference_steps": 0}, "num_inference_steps"),
        ({"n": 9}, "n"),
        ({"n": "2"}, "n"),
        ({"partial_images": 4}, "partial_images"),
        ({"output_format": "gif"}, "output_format"),
        ({"response_format": "url"}, "response_format"),
        ({"guidance_scale": "high"}, "guidance_scale"),
        ({"prompt": ""}, "prompt"),
    ],
)
def test_bad_input_is_a_400_in_openai_form(body: dict[str, Any], param: str) -> None:
    client, engine = make()
    r = client.post(URL, json={"prompt": "x", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"].startswith(param)
    assert not engine.seen


def test_unknown_model_or_style_is_a_404() -> None:
    client, _ = make()
    r = client.post(URL, json={"prompt": "x", "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_full_queue_is_a_429_with_retry_after() -> None:
    client, engine = make()
    engine.queue_full = True
    r = client.post(URL, json={"prompt": "x"})
    assert r.status_code == 429 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["code"] == "queue_full"


# -- listing, metrics, the request log -------------------------------------------------------


def test_models_lists_the_image_model_and_its_styles() -> None:
    client, _ = make()
    data = client.get("/v1/models").json()["data"]
    by_id = {m["id"]: m for m in data}
    assert by_id["tiny-sd"]["kind"] == "image" and by_id["tiny-sd"]["image_limits"]["max_n"] == 4
    assert by_id["ink"]["parent"] == "tiny-sd"


def test_metrics_and_request_log_see_the_image_lane() -> None:
    client, _ = make()
    r = client.post(URL, json={"prompt": "a fox", "n": 2, "num_inference_steps": 5})
    rid = r.headers["x-request-id"]
    client.post(URL, json={"prompt": "x", "size": "7x7"})
    m = parse_samples(client.get("/metrics").text)
    assert m['inferd_image_requests_total{model="tiny-sd",outcome="ok"}'] == 1
    assert m['inferd_image_denoise_seconds_count{model="tiny-sd"}'] == 1
    assert m['inferd_image_images_total{model="tiny-sd"}'] == 2
    assert m['inferd_image_unet_rows_total{model="tiny-sd"}'] == 20
    assert m['inferd_image_denoise_steps_total{model="tiny-sd"}'] == 5
    record = client.get(f"/v1/requests/{rid}").json()
    assert record["lane"] == "image" and record["images"] == 2
    assert len(record["token_ticks"]) == 5
    assert "denoise" in [s["stage"] for s in record["stages"]]
    assert record["stage_order"][-3:] == ["vae_decode", "image_encode", "stream"]
    # The waterfall's preview: the first image, shrunk (32x32 fits in 96 as it is).
    prefix = "data:image/png;base64,"
    assert record["preview"].startswith(prefix)
    thumb = decode(base64.b64decode(record["preview"][len(prefix) :]))
    np.testing.assert_array_equal(thumb, expected("a fox", 1234, n=2)[0])


def test_thumbnails_keep_at_most_the_side_asked() -> None:
    from inferd.gateway.images import thumbnail_url

    image = expected("x", 1, 200, 100)[0]
    url = thumbnail_url(image, side=64)()
    thumb = decode(base64.b64decode(url.split(",", 1)[1]))
    assert thumb.shape == (25, 50, 3)  # every 4th pixel: 200 / 4 = 50 <= 64
    np.testing.assert_array_equal(thumb, image[::4, ::4])


def test_closing_the_events_aborts_the_engine_request() -> None:
    """What a client that leaves does: the route closes the events, the engine drops the job."""
    import asyncio

    from inferd.gateway.images import finalize_image_job, new_image_job, start_image_job

    client, engine = make()
    state = client.app.state.gateway  # type: ignore[attr-defined]

    async def run() -> None:
        engine.gate = asyncio.Event()
        job = new_image_job(state, engine, ImageParams("x"), "r1", 0.0, 0.0)
        task = asyncio.ensure_future(start_image_job(state, job))
        await asyncio.sleep(0.01)
        engine.gate.set()
        events = await task
        await events.aclose()
        finalize_image_job(state, job)

    asyncio.run(run())
    assert engine.aborted == ["r1"] and engine.running == 0
    m = parse_samples(client.get("/metrics").text)
    assert m['inferd_image_requests_total{model="tiny-sd",outcome="abort"}'] == 1


def test_the_openai_client_parses_answers_and_stream_events() -> None:
    import openai
    from openai.types import ImageGenCompletedEvent, ImageGenPartialImageEvent

    client, _ = make()
    oc = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    r = oc.images.generate(prompt="a fox", model="tiny-sd", size="32x32", n=2)
    assert r.size == "32x32" and r.output_format == "png" and r.data and len(r.data) == 2
    stream = oc.images.generate(
        prompt="a fox", stream=True, partial_images=1, extra_body={"num_inference_steps": 4}
    )
    kinds = [type(e) for e in stream]
    assert kinds == [ImageGenPartialImageEvent, ImageGenCompletedEvent]


def test_spans_and_the_access_log_cover_the_image_stages(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from inferd.telemetry.tracing import RequestTracer

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = create_app(
        None, ServerConfig(access_log=True), tracer=RequestTracer(provider.get_tracer("t"))
    )
    app.state.gateway.serves_llm = False
    set_image_engines(app, {"tiny-sd": FakeImageEngine()})
    with caplog.at_level(logging.INFO, logger="inferd.access"):
        r = TestClient(app).post(URL, json={"prompt": "a fox", "num_inference_steps": 3})
    assert r.status_code == 200
    names = {s.name for s in exporter.get_finished_spans()}
    assert {"inferd.request", "inferd.denoise", "inferd.image_encode"} <= names
    line = json.loads(next(m for m in caplog.messages if URL in m))
    assert (line["model"], line["images"], line["steps"], line["outcome"]) == (
        "tiny-sd",
        1,
        3,
        "ok",
    )
    assert "vae_decode" in line["timings"]


def test_the_dashboard_overview_has_the_image_lane() -> None:
    client, _ = make()
    for _ in range(2):
        client.post(URL, json={"prompt": "a fox", "n": 2, "num_inference_steps": 5})
    o = client.get("/v1/dashboard/overview").json()
    assert o["lanes"]["image"] is True and o["image"]["models"] == ["tiny-sd"]
    image = o["image"]
    assert image["requests"] == 2 and image["images_per_s"] == round(4 / o["window_s"], 3)
    assert image["rows_per_forward"] == 4.0  # the fake: n = 2 images, 2 rows each a step
    assert image["queue"] is not None and image["engine"] == {"running": 0, "waiting": 0}
    assert "denoise" in image["stage_seconds"] and image["stage_order"][-1] == "other"


def test_a_server_without_image_models_says_so() -> None:
    client = TestClient(create_app(None, ServerConfig(access_log=False)))
    r = client.post(URL, json={"prompt": "x"})
    assert r.status_code == 404 and "no image model" in r.json()["error"]["message"]
    assert client.post("/v2/models/tiny-sd/infer", json={"inputs": []}).status_code == 404


def test_styles_load_and_unload_through_the_adapter_routes(tmp_path: Path) -> None:
    """On a server without an LLM every path is the image model's (no file is read here: the
    fake engine takes any path)."""
    fake = FakeImageEngine("tiny-sd", styles=["ink"])
    app = create_app(None, ServerConfig(access_log=False), lora_updates=True)
    app.state.gateway.serves_llm = False
    set_image_engines(app, {fake.model_name: fake})
    client = TestClient(app, raise_server_exceptions=False)
    load = {"lora_name": "oil", "lora_path": str(tmp_path)}
    r = client.post("/v1/load_lora_adapter", json=load)
    assert r.status_code == 200 and "added successfully" in r.text
    cards = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert cards["oil"]["parent"] == "tiny-sd"
    taken = client.post("/v1/load_lora_adapter", json={**load, "lora_name": "ink"})
    assert taken.status_code == 400 and taken.json()["error"]["param"] == "lora_name"
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "oil"}).status_code == 200
    again = client.post("/v1/unload_lora_adapter", json={"lora_name": "oil"})
    assert again.status_code == 404 and again.json()["error"]["code"] == "model_not_found"
    assert fake.styles() == ["ink"]
    off, _ = make()  # without the environment's runtime-update gate: no such routes
    assert off.post("/v1/load_lora_adapter", json=load).status_code == 404
