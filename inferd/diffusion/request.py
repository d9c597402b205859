"""The image lane's typed messages: what the gateway hands the image engine, and what comes back.

    engine: ImageEngine = ...
    request = ImageRequest("img-1", ImageParams(prompt="a red fox", num_inference_steps=20))
    async for event in engine.generate(request):
        if isinstance(event, DenoiseProgress) and event.preview is not None:
            ...                            # a partial image: the current latents, decoded
        elif isinstance(event, ImagesDone):
            pixels = event.images          # uint8 [n, height, width, 3]

The gateway checks the protocol (types, `size` syntax, ranges the API fixes); the engine checks
the model's own limits (`ImageLimits`) and refuses with `InvalidRequestError` (400) or
`ModelNotFoundError` (404, an unknown style) before anything is queued. Closing the iterator
early (a client that went away) aborts the request: it leaves the batch at the next step
boundary and its latents are freed. This module imports neither torch nor diffusers, so the
gateway can hold these types.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from inferd.telemetry.stages import StageTimings

Pixels = npt.NDArray[np.uint8]  # [n, height, width, 3], RGB


@dataclass(frozen=True, slots=True)
class ImageParams:
    """One generation: `n` images of one prompt. Zero `width`/`height`/`num_inference_steps` and
    a None `guidance_scale` take the model's defaults (`ImageLimits`); a None `seed` draws one."""

    prompt: str
    negative_prompt: str = ""
    n: int = 1
    width: int = 0
    height: int = 0
    num_inference_steps: int = 0
    guidance_scale: float | None = None
    seed: int | None = None
    # The LoRA style, by its served name (the request's `model` field); None is the base model.
    lora_name: str | None = None
    # Decoded previews of the latents to send while denoising (OpenAI's `partial_images`, 0-3).
    partial_images: int = 0


@dataclass(slots=True)
class ImageRequest:
    request_id: str
    params: ImageParams
    priority: int = 0
    # CLOCK_MONOTONIC instant after which the request is dropped at the next step boundary.
    deadline: float | None = None
    # Carries the gateway's receive/validate times in and the engine's stages out.
    timings: StageTimings = field(default_factory=StageTimings)


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What a served image model accepts; the engine enforces it, `/v1/models` may show it."""

    default_width: int
    default_height: int
    max_width: int
    max_height: int
    size_multiple: int  # width and height must be multiples (the VAE's scale factor)
    default_steps: int
    max_steps: int
    default_guidance_scale: float
    max_n: int


@dataclass(frozen=True, slots=True)
class DenoiseProgress:
    """After denoising step `step` (1-based) of `num_steps`; `preview` is set on the steps that
    carry a partial image (`partial_index` counts them from 0)."""

    step: int
    num_steps: int
    preview: Pixels | None = None
    partial_index: int = -1


@dataclass(frozen=True, slots=True)
class ImagesDone:
    images: Pixels
    seed: int
    timings: StageTimings


ImageEvent = DenoiseProgress | ImagesDone


@dataclass(frozen=True, slots=True)
class ImageEngineStats:
    """Counters since start (monotonic, for rates) and gauges now: what the metrics and the
    dashboard's image lane read."""

    running: int  # requests denoising now
    waiting: int  # requests in the admission queue
    images_total: int  # images finished
    requests_total: int  # requests finished (any outcome)
    unet_forwards_total: int  # UNet forwards (one per engine step and resolution bucket)
    unet_rows_total: int  # rows those forwards ran (a CFG request at n images: 2n rows a step)
    denoise_steps_total: int  # request-steps advanced (each request once per forward it is in)


class ImageEngine(Protocol):
    """The image engine as the gateway sees it (one per served image model)."""

    @property
    def model_name(self) -> str: ...

    @property
    def limits(self) -> ImageLimits: ...

    def styles(self) -> list[str]:
        """The LoRA styles this model serves, by name."""
        ...

    async def add_style(self, name: str, path: str) -> None:
        """Serves the LoRA file(s) at `path` as the style `name` once read: InvalidRequestError
        (400) for a refused file or a taken name, or when the model serves no styles."""
        ...

    async def remove_style(self, name: str) -> bool:
        """Stops serving `name` (requests running it finish first); False if unknown."""
        ...

    def ready(self) -> bool: ...

    def stats(self) -> ImageEngineStats: ...

    def generate(self, request: ImageRequest) -> AsyncIterator[ImageEvent]:
        """One `DenoiseProgress` per denoising step (the last one too), then exactly one
        `ImagesDone`; raises an `InferdError` for a refused
        or failed request (`QueueFullError` when the admission queue is full)."""
        ...
