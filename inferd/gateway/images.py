"""The image lane in the gateway, shared by its protocols (OpenAI images, KServe v2).

    engine, style = resolve_image_model(state, body.model)    # 404 for an unknown name
    job = new_image_job(state, engine, params, request_id, arrival, received)
    events = await start_image_job(job)        # admission: 400/404/429/503 raised here
    async for progress in follow(job, events): ...            # or: done = await finish(job, events)
    finalize_image_job(state, job)             # metrics, request log, trace (idempotent)

A request's `model` names a served image model or one of its LoRA styles (`engine.styles()`);
the style becomes `ImageParams.lora_name`. The gateway measures receive, validate,
image_encode and stream; the engine reports queue through vae_decode in
`ImagesDone.timings`, merged into the job's timeline. Each denoising step is recorded as a
tick (the timeline's token instants, from the progress events), which the dashboard's
waterfall draws on `denoise`.
Closing the event stream (a client that left) aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from dataclasses import asdict, dataclass

import numpy as np

from inferd.diffusion.request import (
    DenoiseProgress,
    ImageEngine,
    ImageEvent,
    ImageParams,
    ImageRequest,
    ImagesDone,
    Pixels,
)
from inferd.errors import (
    InferdError,
    InvalidRequestError,
    ModelNotFoundError,
    QueueFullError,
    QueueTimeoutError,
)
from inferd.gateway.errors import APIError, model_not_found, unavailable
from inferd.gateway.responses import Peeked, aclose_quietly
from inferd.gateway.state import GatewayState
from inferd.postprocess.image_encode import ImageFormat, encode_image, encode_images
from inferd.telemetry.stages import Stage
from inferd.telemetry.timeline import DisabledTimeline, RequestTimeline

# The dashboard's preview of an image request: its first image, at most this many pixels a side.
THUMBNAIL_SIDE = 96
# What the gateway measures itself; every other stage of the timeline is the engine's.
GATEWAY_STAGES = frozenset({Stage.RECEIVE, Stage.VALIDATE, Stage.IMAGE_ENCODE, Stage.STREAM})


def find_image_model(state: GatewayState, name: str) -> tuple[ImageEngine, str | None] | None:
    """The image engine serving `name` and the style it names (None: the base model); None when
    `name` is no image model nor style."""
    engine = state.images.get(name)
    if engine is not None:
        return engine, None
    for engine in state.images.values():
        if name in engine.styles():
            return engine, name
    return None


def resolve_image_model(state: GatewayState, name: str | None) -> tuple[ImageEngine, str | None]:
    """As `find_image_model`; no name picks the first served image model. Raises 404
    `model_not_found` for an unknown name, 503 while the engine loads or the server drains."""
    if state.draining:
        raise unavailable("the server is shutting down", "draining")
    if name is None:
        if not state.images:
            raise APIError(
                404,
                "this server serves no image model (start it with one, e.g. --image-model)",
                type="not_found_error",
                param="model",
                code="model_not_found",
                reason="not_found",
            )
        name = next(iter(state.images))
    found = find_image_model(state, name)
    if found is None:
        raise model_not_found(name)
    if not found[0].ready():
        raise unavailable(f"the image model {found[0].model_name!r} is still loading", "not_ready")
    return found


def image_model_cards(state: GatewayState) -> list[dict[str, object]]:
    """The /v1/models entries of the image models, each followed by its styles (with `parent`,
    as LoRA adapters of the LLM are listed)."""
    created = int(state.started)
    cards: list[dict[str, object]] = []
    for name, engine in state.images.items():
        card = {"id": name, "object": "model", "created": created, "owned_by": "inferd"}
        cards.append({**card, "kind": "image", "image_limits": asdict(engine.limits)})
        for style in engine.styles():
            cards.append({**card, "id": style, "kind": "image", "parent": name})
    return cards


@dataclass
class ImageJob:
    """One image request in the gateway: what it asked, and what its response accumulated."""

    request: ImageRequest
    engine: ImageEngine
    timeline: RequestTimeline
    done: ImagesDone | None = None
    # The last progress event's step and step count (0: none seen yet).
    step: int = 0
    num_steps: int = 0
    # "ok" once the images were sent; else why not (see telemetry.image_metrics.IMAGE_OUTCOMES).
    outcome: str = "abort"
    finalized: bool = False
    # A whole (non-streamed) body: when it was handed to the server to send.
    send_started: float | None = None

    @property
    def params(self) -> ImageParams:
        return self.request.params

    @property
    def model(self) -> str:
        """The name the response reports: the style when one was named, else the model."""
        return self.params.lora_name or self.engine.model_name


def new_image_job(
    state: GatewayState,
    engine: ImageEngine,
    params: ImageParams,
    request_id: str,
    arrival: float,
    received: float,
    *,
    priority: int = 0,
    timeout_s: float | None = None,
) -> ImageJob:
    """The job with `receive` (arrival to `received`, when the body was decoded) and
    `validate` (from then to now) measured."""
    make = RequestTimeline if state.server.telemetry else DisabledTimeline
    timeline = make(request_id, arrival=arrival)
    timeline.add(Stage.RECEIVE, received - arrival, arrival)
    timeline.add(Stage.VALIDATE, time.monotonic() - received, received)
    timeline.lora_name = params.lora_name
    deadline = None if timeout_s is None else arrival + timeout_s
    request = ImageRequest(request_id, params, priority, deadline, timings=timeline.stages)
    return ImageJob(request, engine, timeline)


# The engine's events with the first one already taken (see `start_image_job`).
ImageEvents = Peeked[ImageEvent]


async def start_image_job(state: GatewayState, job: ImageJob) -> ImageEvents:
    """Submits the request and waits for its first event; a refusal raises here (and is
    recorded), with the iterator already closed."""
    state.admitting()
    events: AsyncIterator[ImageEvent] | None = None
    try:
        events = job.engine.generate(job.request)
        first = await anext(events)
    except StopAsyncIteration:
        job.outcome = "error"
        raise InferdError("the image engine ended the request without output") from None
    except BaseException as e:
        job.outcome = refusal_outcome(e)
        if events is not None:
            await aclose_quietly(events)
        finalize_image_job(state, job)
        raise
    return Peeked(first, events)


def refusal_outcome(exc: BaseException) -> str:
    if isinstance(exc, InvalidRequestError):
        return "invalid"
    if isinstance(exc, ModelNotFoundError):
        return "not_found"
    if isinstance(exc, QueueFullError):
        return "queue_full"
    if isinstance(exc, QueueTimeoutError):
        return "queue_timeout"
    if isinstance(exc, APIError) and exc.status < 500:
        return "invalid" if exc.status == 400 else exc.reason
    return "abort" if not isinstance(exc, Exception) else "error"


async def follow(job: ImageJob, events: ImageEvents) -> AsyncIterator[DenoiseProgress]:
    """The progress events, one per step (the engine's contract, `ImageEngine.generate`); the
    final images land in `job.done` (stages merged). Raises an `InferdError` when the engine
    fails the request. The caller closes `events`."""
    async for event in events:
        if isinstance(event, ImagesDone):
            record_done(job, event)
            return
        job.timeline.on_tokens(max(event.step - job.step, 1))
        job.step, job.num_steps = event.step, event.num_steps
        yield event
    job.outcome = "error"
    raise InferdError("the image engine ended the request without its images")


async def finish(job: ImageJob, events: ImageEvents) -> ImagesDone:
    """Runs the request to its images (the non-streaming path); closes `events`."""
    try:
        async for _ in follow(job, events):
            pass
    except InferdError:
        job.outcome = "error"
        raise
    finally:
        await events.aclose()
    assert job.done is not None
    return job.done


def record_done(job: ImageJob, done: ImagesDone) -> None:
    """Merges the engine's stages into the timeline (the gateway's own stay as measured), and
    ticks the steps no progress event reported (an engine may end with `ImagesDone` instead of
    a last progress event) at the end of `denoise`."""
    job.done = done
    stages = job.timeline.stages
    if done.timings is not stages:
        for stage, seconds in done.timings.seconds.items():
            if stage not in GATEWAY_STAGES:
                stages.set(stage, seconds, done.timings.starts.get(stage))
    start = stages.starts.get(Stage.DENOISE)
    if job.step < job.num_steps and start is not None:
        job.timeline.on_tokens(job.num_steps - job.step, start + stages.seconds[Stage.DENOISE])
        job.step = job.num_steps


def finalize_image_job(state: GatewayState, job: ImageJob, outcome: str | None = None) -> None:
    """Records the finished request in metrics, the request log and traces; safe to call more
    than once (the first call counts)."""
    if job.finalized:
        return
    job.finalized = True
    if outcome is not None:
        job.outcome = outcome
    if job.send_started is not None:  # the send of a whole body is part of `stream`
        job.timeline.add(Stage.STREAM, time.monotonic() - job.send_started)
    if not state.server.telemetry or state.image_metrics is None:
        return
    timeline = job.timeline
    timeline.finish()
    images = 0 if job.done is None else len(job.done.images)
    preview = None
    if job.done is not None and images and state.image_metrics.request_log is not None:
        preview = thumbnail_url(job.done.images[0])
    state.image_metrics.observe(
        job.engine.model_name, timeline, job.outcome, job.params.lora_name, images, preview
    )
    if state.tracer is not None:
        attrs = {
            "inferd.kind": "image",
            "inferd.model": job.engine.model_name,
            "inferd.images": images,
            "inferd.steps": timeline.num_output_tokens,
        }
        with suppress(Exception):
            state.tracer.export(timeline, attrs)


async def encode(
    job: ImageJob, pixels: Pixels, fmt: ImageFormat, compression: int | None
) -> list[bytes]:
    """The images as files, timed as the job's `image_encode`; off the event loop (Pillow
    releases the GIL while compressing)."""
    return await asyncio.to_thread(encode_images, pixels, fmt, compression, job.timeline.stages)


def size_of(pixels: Pixels) -> str:
    """`"WIDTHxHEIGHT"` of `[n, H, W, 3]` pixels."""
    return f"{pixels.shape[2]}x{pixels.shape[1]}"


def thumbnail_url(image: Pixels, side: int = THUMBNAIL_SIDE) -> Callable[[], str]:
    """A PNG data URL of `image` `[H, W, 3]` shrunk to at most `side` pixels a side, made when
    called; the shrunk copy (a strided view, copied: ~12 KB) is all the closure keeps."""
    step = max(-(-max(image.shape[:2]) // side), 1)
    small = np.ascontiguousarray(image[::step, ::step])

    def url() -> str:
        return "data:image/png;base64," + base64.b64encode(encode_image(small, "png")).decode()

    return url


def access_fields(job: ImageJob) -> dict[str, object]:
    """What the access log line adds for an image request."""
    return {
        "model": job.model,
        "images": 0 if job.done is None else len(job.done.images),
        "steps": job.timeline.num_output_tokens,
        "outcome": job.outcome,
        "timings": job.timeline.as_dict(),
    }
