"""WebSocket progress for the image lane: /v1/images/generations/ws, with binary image frames.

Protocol (one request at a time per connection, as /v1/*/ws):
  client -> server: a text frame with a request body, exactly as for POST
                    /v1/images/generations (`stream` is implied), or {"type": "cancel"}.
  server -> client: per denoising step a text frame
                        {"type": "progress", "step": 3, "num_steps": 20}
                    for each partial image (`partial_images`, 0-3) and then each final image,
                    a text frame that announces it, then one binary frame with the file's bytes:
                        {"type": "partial_image", "partial_image_index": 0, "image_index": 0,
                         "output_format": "png", "size": "64x64", "bytes": 5120}
                        {"type": "image", "image_index": 0, "output_format": "png", ...}
                    and last {"type": "completed", "seed": 7, "size": "64x64", "timings": {...}}
                    then the text `[DONE]`. An error is OpenAI's error object (plus "status"),
                    then `[DONE]`.
Closing the connection, or a cancel, aborts the request in the engine at its next step.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress
from typing import Any

import orjson
from fastapi import APIRouter, WebSocket

from inferd.diffusion.request import Pixels
from inferd.errors import InferdError
from inferd.gateway.errors import APIError, to_api_error
from inferd.gateway.images import (
    ImageEvents,
    ImageJob,
    encode,
    finalize_image_job,
    follow,
    new_image_job,
    resolve_image_model,
    size_of,
    start_image_job,
)
from inferd.gateway.openai.image_protocol import ImageGenerationRequest
from inferd.gateway.openai.websocket import (
    DONE,
    Inbox,
    parse_message,
    send_error,
    serve_ws,
    until_done_or_cancel,
)
from inferd.gateway.state import GatewayState
from inferd.telemetry.stages import Stage

router = APIRouter()


@router.websocket("/v1/images/generations/ws")
async def images_ws(ws: WebSocket) -> None:
    await serve_ws(ws, _one_request)


async def _one_request(
    ws: WebSocket, state: GatewayState, inbox: Inbox, message: Any, arrival: float, rid: str
) -> bool:
    """Serves one request; True when the client closed the connection meanwhile. Admission
    runs inside the producer, so a cancel or a close also ends a request still queued."""
    received = time.monotonic()
    try:
        body = parse_message(ImageGenerationRequest, message)
        engine, style = resolve_image_model(state, body.model)
        job = new_image_job(
            state, engine, body.params(style), rid, arrival, received, priority=body.priority
        )
    except (APIError, InferdError) as e:
        await send_error(ws, state, to_api_error(e))
        return False
    state.inflight += 1
    producer = asyncio.create_task(_run(ws, state, job, body))
    try:
        return await until_done_or_cancel(ws, producer, inbox)
    finally:
        state.inflight -= 1
        finalize_image_job(state, job)


async def _run(
    ws: WebSocket, state: GatewayState, job: ImageJob, body: ImageGenerationRequest
) -> None:
    try:
        events = await start_image_job(state, job)
    except (APIError, InferdError) as e:
        await send_error(ws, state, to_api_error(e))
        return
    try:
        await _produce(ws, job, events, body)
    finally:
        await events.aclose()


async def _produce(
    ws: WebSocket, job: ImageJob, events: ImageEvents, body: ImageGenerationRequest
) -> None:
    try:
        async for progress in follow(job, events):
            step = {"type": "progress", "step": progress.step, "num_steps": progress.num_steps}
            await _send(ws, job, orjson.dumps(step).decode())
            if progress.preview is not None:
                extra: dict[str, object] = {"partial_image_index": progress.partial_index}
                await _send_images(ws, job, body, progress.preview, "partial_image", extra)
        assert job.done is not None
        await _send_images(ws, job, body, job.done.images, "image", {})
        job.outcome = "ok"
        completed = {
            "type": "completed",
            "seed": job.done.seed,
            "size": size_of(job.done.images),
            "timings": job.timeline.as_dict(time.monotonic()),
        }
        await _send(ws, job, orjson.dumps(completed).decode())
    except (InferdError, APIError) as e:
        job.outcome = "error"
        err = to_api_error(e)
        with suppress(Exception):
            await ws.send_text(orjson.dumps({**err.body(), "status": err.status}).decode())
    await ws.send_text(DONE)


async def _send_images(
    ws: WebSocket,
    job: ImageJob,
    body: ImageGenerationRequest,
    pixels: Pixels,
    kind: str,
    extra: dict[str, object],
) -> None:
    """Each image as an announcing text frame and a binary frame with its file."""
    fmt = body.format
    files = await encode(job, pixels, fmt, body.output_compression)
    for i, data in enumerate(files):
        head = {"type": kind, **extra, "image_index": i, "output_format": fmt}
        head |= {"size": size_of(pixels), "bytes": len(data)}
        await _send(ws, job, orjson.dumps(head).decode())
        await _send(ws, job, data)


async def _send(ws: WebSocket, job: ImageJob, frame: str | bytes) -> None:
    t0 = time.monotonic()
    if isinstance(frame, bytes):
        await ws.send_bytes(frame)
    else:
        await ws.send_text(frame)
    job.timeline.add(Stage.STREAM, time.monotonic() - t0, t0)
