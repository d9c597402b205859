"""`POST /v1/images/generations`: OpenAI's Images API on the image lane.

Three answers to one body (image_protocol.py):

- JSON (the default, `response_format: "b64_json"`): `{created, data: [{b64_json}],
  output_format, size, background, seed, timings}`;
- the raw bytes of the one image (`n` = 1) with `response_format: "file"` or an `Accept:
  image/png` (`image/jpeg`, `image/webp`: that format) header: no base64 in JSON, no 33 % bloat;
- `stream: true`: server-sent events as OpenAI sends them, `image_generation.partial_image`
  (`partial_images` previews of the latents while denoising, 0-3) then one
  `image_generation.completed` per image, the last one carrying `timings`.

Errors are OpenAI's JSON: 400 before anything is queued (sizes, steps, `n`, types), 404
`model_not_found` for a name that is no image model nor style, 429 with Retry-After when the
image queue is full. A client that leaves aborts the request in the engine.
"""

from __future__ import annotations

import base64
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from inferd.diffusion.request import ImageParams, Pixels
from inferd.errors import InferdError
from inferd.gateway.contract import json_or, openai_errors
from inferd.gateway.errors import APIError, bad_request, to_api_error
from inferd.gateway.images import (
    ImageEvents,
    ImageJob,
    access_fields,
    encode,
    finalize_image_job,
    finish,
    follow,
    new_image_job,
    resolve_image_model,
    size_of,
    start_image_job,
)
from inferd.gateway.openai.image_protocol import ImageGenerationRequest, ImagesResponse
from inferd.gateway.openai.routes import CLIENT_CLOSED, ClientGone, race_disconnect
from inferd.gateway.responses import FinalizingResponse, FinalizingStreamingResponse, run_once
from inferd.gateway.state import GatewayState, gateway
from inferd.postprocess.image_encode import MEDIA_TYPES, ImageFormat
from inferd.telemetry.stages import Stage

router = APIRouter()

_BY_MEDIA_TYPE: dict[str, ImageFormat] = {v: k for k, v in MEDIA_TYPES.items()}
_RESPONSES = {
    **json_or(
        "text/event-stream",
        ImagesResponse,
        "The images as base64 JSON; with `stream: true` server-sent events "
        "(`image_generation.partial_image`, then `image_generation.completed` per image)",
    ),
    **openai_errors(400, 404, 413, 429, 503, 500),
}
_RESPONSES[200]["content"] |= {t: {"schema": {"type": "string"}} for t in MEDIA_TYPES.values()}


@router.post("/v1/images/generations", response_model=None, responses=_RESPONSES)
async def generate_images(body: ImageGenerationRequest, request: Request) -> Response:
    received = time.monotonic()
    state = gateway(request)
    st = request.state
    file_format = _file_format(body, request.headers.get("accept", ""))
    engine, style = resolve_image_model(state, body.model)
    params = _params(body, style, file_format)
    job = new_image_job(
        state, engine, params, st.request_id, st.arrival, received, priority=body.priority
    )
    job.timeline.traceparent = request.headers.get("traceparent")
    try:
        events = await race_disconnect(request, start_image_job(state, job))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    state.inflight += 1
    done = _on_done(state, job, request, events)
    fmt = file_format or body.format
    if body.stream:
        sse = _stream(job, events, body, fmt)
        return FinalizingStreamingResponse(sse, done, media_type="text/event-stream")
    try:
        await race_disconnect(request, finish(job, events))
    except ClientGone:
        await done()
        return Response(status_code=CLIENT_CLOSED)
    except BaseException:
        await done()
        raise
    assert job.done is not None
    files = await encode(job, job.done.images, fmt, body.output_compression)
    if file_format is not None:
        content, media_type = files[0], MEDIA_TYPES[fmt]
        job.outcome = "ok"
    else:
        content, media_type = _json_body(job, files, fmt), "application/json"
    job.send_started = time.monotonic()
    return FinalizingResponse(content, done, media_type=media_type)


def _file_format(body: ImageGenerationRequest, accept: str) -> ImageFormat | None:
    """The format to answer with raw bytes (an image media type in Accept before any JSON one,
    or `"file"`); None: JSON or events."""
    fmt = None
    for media_type in (t.split(";")[0].strip() for t in accept.split(",")):
        if media_type in ("application/json", "text/event-stream"):
            break  # JSON (or events) is named first: the client reads base64
        if media_type in _BY_MEDIA_TYPE:
            fmt = _BY_MEDIA_TYPE[media_type]
            break
    if fmt is None and body.response_format == "file":
        fmt = body.format
    if fmt is not None and body.stream:
        raise bad_request("raw image bytes cannot be streamed: drop stream or the Accept type")
    return fmt


def _params(
    body: ImageGenerationRequest, style: str | None, file: ImageFormat | None
) -> ImageParams:
    params = body.params(style)
    if file is not None and params.n != 1:
        raise bad_request("raw image bytes carry one image: ask for n = 1, or use b64_json", "n")
    return params


def _json_body(job: ImageJob, files: list[bytes], fmt: ImageFormat) -> bytes:
    """The JSON response with `timings` last, its `stream` stage being this encoding."""
    assert job.done is not None
    t0 = time.monotonic()
    body = {
        "created": int(time.time()),
        "data": [{"b64_json": base64.b64encode(f).decode()} for f in files],
        "output_format": fmt,
        "size": size_of(job.done.images),
        "background": "opaque",
        "seed": job.done.seed,
    }
    encoded = orjson.dumps(body)
    t1 = time.monotonic()
    job.timeline.add(Stage.STREAM, t1 - t0, t0)
    job.outcome = "ok"
    timings = job.timeline.as_dict(t1)
    if not timings:
        return encoded
    return encoded[:-1] + b',"timings":' + orjson.dumps(timings) + b"}"


async def _stream(
    job: ImageJob, events: ImageEvents, body: ImageGenerationRequest, fmt: ImageFormat
) -> AsyncIterator[bytes]:
    """OpenAI's image stream events; an error after the stream started ends it with one
    `{"error": {...}}` event."""
    try:
        async for progress in follow(job, events):
            if progress.preview is None:
                continue
            files = await encode(job, progress.preview, fmt, body.output_compression)
            for i, f in enumerate(files):
                yield _event(job, "image_generation.partial_image", f, fmt, progress.preview, i,
                             partial_image_index=progress.partial_index)  # fmt: skip
        assert job.done is not None
        images = job.done.images
        files = await encode(job, images, fmt, body.output_compression)
        for i, f in enumerate(files):
            extra = {}
            if i == len(files) - 1:
                job.outcome = "ok"
                extra = {"timings": job.timeline.as_dict(time.monotonic())}
            yield _event(job, "image_generation.completed", f, fmt, images, i, **extra)
    except (InferdError, APIError) as e:
        job.outcome = "error"
        yield b"event: error\ndata: " + orjson.dumps(to_api_error(e).body()) + b"\n\n"


def _event(
    job: ImageJob, kind: str, file: bytes, fmt: ImageFormat, pixels: Pixels, index: int,
    **extra: object,
) -> bytes:  # fmt: skip
    """One server-sent event: `event: <type>` and the event's JSON (OpenAI's fields, plus
    `image_index` when a request asked for several images)."""
    t0 = time.monotonic()
    data: dict[str, object] = {
        "type": kind,
        "b64_json": base64.b64encode(file).decode(),
        "background": "opaque",
        "created_at": int(time.time()),
        "output_format": fmt,
        "quality": "auto",
        "size": size_of(pixels),
        **extra,
    }
    if job.params.n > 1:
        data["image_index"] = index
    out = b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
    job.timeline.add(Stage.STREAM, time.monotonic() - t0, t0)
    return out


def _on_done(
    state: GatewayState, job: ImageJob, request: Request, events: ImageEvents
) -> Callable[[], Awaitable[None]]:
    async def done() -> None:
        state.inflight -= 1
        await events.aclose()
        finalize_image_job(state, job)
        request.state.access_extra = access_fields(job)

    return run_once(done)
