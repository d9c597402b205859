"""/v1/images/generations/ws against a faked image engine: progress frames, binary image
frames, errors, cancel and close."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import numpy as np
from fake_image_engine import fake_pixels
from PIL import Image
from starlette.testclient import WebSocketTestSession
from test_images_gateway import make

from inferd.diffusion.request import ImageParams

WS = "/v1/images/generations/ws"


def frames(ws: WebSocketTestSession) -> list[Any]:
    """Every frame up to `[DONE]`: JSON objects, and bytes for binary frames."""
    out: list[Any] = []
    while True:
        message = ws.receive()
        if message.get("bytes") is not None:
            out.append(message["bytes"])
            continue
        if message["text"] == "[DONE]":
            return out
        out.append(json.loads(message["text"]))


def test_progress_then_partial_and_final_images_as_binary_frames() -> None:
    client, _ = make()
    with client.websocket_connect(WS) as ws:
        ws.send_text(json.dumps({"prompt": "a fox", "n": 2, "num_inference_steps": 4,
                                 "partial_images": 1, "seed": 5}))  # fmt: skip
        got = frames(ws)
    kinds = [f["type"] if isinstance(f, dict) else "bytes" for f in got]
    assert kinds == (
        ["progress", "progress"]
        + ["partial_image", "bytes"] * 2
        + ["progress", "progress"]
        + ["image", "bytes"] * 2
        + ["completed"]
    )
    assert [f["step"] for f in got if isinstance(f, dict) and f["type"] == "progress"] == [
        1,
        2,
        3,
        4,
    ]
    want = fake_pixels(ImageParams("a fox", n=2), 5, 32, 32)
    finals = [got[i + 1] for i, f in enumerate(got) if isinstance(f, dict) and f["type"] == "image"]
    for i, data in enumerate(finals):
        head = got[got.index(data) - 1]
        assert head["image_index"] == i and head["bytes"] == len(data) and head["size"] == "32x32"
        np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(data))), want[i])
    completed = got[-1]
    assert completed["seed"] == 5 and "denoise" in completed["timings"]


def test_errors_keep_the_connection_for_the_next_request() -> None:
    client, _ = make()
    with client.websocket_connect(WS) as ws:
        ws.send_text(json.dumps({"prompt": "x", "size": "30x30"}))
        (err,) = frames(ws)
        assert err["status"] == 400 and err["error"]["param"] == "size"
        ws.send_text("{not json")
        (err,) = frames(ws)
        assert err["error"]["code"] == "invalid_json"
        ws.send_text(json.dumps({"prompt": "x", "num_inference_steps": 2}))
        assert frames(ws)[-1]["type"] == "completed"


def test_cancel_aborts_the_request_in_the_engine() -> None:
    client, engine = make()
    engine.gate = asyncio.Event()  # never set: the request waits before its first step
    with client.websocket_connect(WS) as ws:
        ws.send_text(json.dumps({"prompt": "x"}))
        ws.send_text(json.dumps({"type": "cancel"}))
        assert frames(ws) == []
        ws.send_text(json.dumps({"type": "cancel"}))  # nothing running: ignored
    assert len(engine.aborted) == 1 and engine.running == 0
    metrics = client.get("/metrics").text
    assert 'inferd_image_requests_total{model="tiny-sd",outcome="abort"} 1.0' in metrics
