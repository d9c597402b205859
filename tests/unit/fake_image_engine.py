"""A faked `ImageEngine` for gateway tests: the protocol's behaviour without a model.

    engine = FakeImageEngine("tiny-sd", styles=["ink"])
    set_image_engines(app, {"tiny-sd": engine})

It checks `ImageLimits` as a real engine must (400 `InvalidRequestError`, 404
`ModelNotFoundError` for an unknown style), yields one `DenoiseProgress` per step (with a decoded
preview on the steps `partial_images` asks for) and then one `ImagesDone` whose pixels are a
deterministic function of the request (`fake_pixels`), so tests can compare bytes. `queue_full`
makes the next request fail with `QueueFullError`; `gate` (an asyncio.Event) holds every request
before its first step, so a test decides when denoising goes on; `fail` (an InferdError) is raised
after the first step; `aborted` collects the ids of requests whose iterator was
closed before they finished.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import numpy as np

from inferd.diffusion.request import (
    DenoiseProgress,
    ImageEngineStats,
    ImageEvent,
    ImageLimits,
    ImageParams,
    ImageRequest,
    ImagesDone,
    Pixels,
)
from inferd.errors import InferdError, InvalidRequestError, ModelNotFoundError, QueueFullError
from inferd.telemetry.stages import Stage, StageTimings

LIMITS = ImageLimits(
    default_width=32,
    default_height=32,
    max_width=64,
    max_height=64,
    size_multiple=8,
    default_steps=4,
    max_steps=20,
    default_guidance_scale=5.0,
    max_n=4,
)


def fake_pixels(params: ImageParams, seed: int, width: int, height: int) -> Pixels:
    """`[n, height, width, 3]` uint8 pixels that depend on prompt, seed and size only."""
    base = sum(params.prompt.encode()) + seed
    n = np.arange(params.n, dtype=np.int64)[:, None, None, None]
    y = np.arange(height, dtype=np.int64)[None, :, None, None]
    x = np.arange(width, dtype=np.int64)[None, None, :, None]
    c = np.arange(3, dtype=np.int64)[None, None, None, :]
    return ((base + 31 * n + 7 * y + 3 * x + 85 * c) % 256).astype(np.uint8)


class FakeImageEngine:
    def __init__(
        self,
        model_name: str = "tiny-sd",
        styles: list[str] | None = None,
        limits: ImageLimits = LIMITS,
    ) -> None:
        self._name = model_name
        self._styles = list(styles or [])
        self._limits = limits
        self.queue_full = False
        self.gate: asyncio.Event | None = None
        self.fail: InferdError | None = None
        self.aborted: list[str] = []
        self.seen: list[ImageRequest] = []
        self.running = 0
        self.images_total = 0
        self.requests_total = 0
        self.steps_total = 0
        self.forwards_total = 0
        self.rows_total = 0

    @property
    def model_name(self) -> str:
        return self._name

    @property
    def limits(self) -> ImageLimits:
        return self._limits

    def styles(self) -> list[str]:
        return list(self._styles)

    async def add_style(self, name: str, path: str) -> None:
        if name in self._styles:
            raise InvalidRequestError(f"the style {name!r} is already served", "lora_name")
        self._styles.append(name)

    async def remove_style(self, name: str) -> bool:
        if name not in self._styles:
            return False
        self._styles.remove(name)
        return True

    def ready(self) -> bool:
        return True

    def stats(self) -> ImageEngineStats:
        return ImageEngineStats(
            running=self.running,
            waiting=0,
            images_total=self.images_total,
            requests_total=self.requests_total,
            unet_forwards_total=self.forwards_total,
            unet_rows_total=self.rows_total,
            denoise_steps_total=self.steps_total,
        )

    def check(self, p: ImageParams) -> tuple[int, int, int]:
        """The model's limits, as a real engine checks them: (width, height, steps)."""
        lim = self._limits
        width, height = p.width or lim.default_width, p.height or lim.default_height
        steps = p.num_inference_steps or lim.default_steps
        for name, value, top in (
            ("width", width, lim.max_width),
            ("height", height, lim.max_height),
        ):
            if value % lim.size_multiple or value > top:
                raise InvalidRequestError(
                    f"{name} {value} must be a multiple of {lim.size_multiple} and <= {top}",
                    "size",
                )
        if not 1 <= steps <= lim.max_steps:
            raise InvalidRequestError(f"steps must be 1..{lim.max_steps}", "num_inference_steps")
        if not 1 <= p.n <= lim.max_n:
            raise InvalidRequestError(f"n must be 1..{lim.max_n}", "n")
        if p.lora_name is not None and p.lora_name not in self._styles:
            raise ModelNotFoundError(f"The model {p.lora_name!r} does not exist")
        return width, height, steps

    def generate(self, request: ImageRequest) -> AsyncIterator[ImageEvent]:
        width, height, steps = self.check(request.params)
        if self.queue_full:
            raise QueueFullError("the image queue is full", retry_after=2.0)
        self.seen.append(request)
        return self._run(request, width, height, steps)

    async def _run(
        self, request: ImageRequest, width: int, height: int, steps: int
    ) -> AsyncIterator[ImageEvent]:
        p = request.params
        seed = p.seed if p.seed is not None else 1234
        pixels = fake_pixels(p, seed, width, height)
        timings = StageTimings()
        with timings.measure(Stage.TEXT_ENCODE):
            await asyncio.sleep(0)
        t_queue = time.monotonic()
        self.running += 1
        finished = False
        try:
            if self.gate is not None:
                await self.gate.wait()
            t0 = time.monotonic()
            timings.add(Stage.QUEUE, t0 - t_queue, t_queue)
            rows = p.n * 2
            for step in range(1, steps + 1):
                await asyncio.sleep(0)
                self.steps_total += 1
                self.forwards_total += 1
                self.rows_total += rows
                yield DenoiseProgress(step, steps, *_preview(pixels, step, steps, p.partial_images))
                if self.fail is not None:
                    raise self.fail
            timings.add(Stage.DENOISE, time.monotonic() - t0, t0)
            with timings.measure(Stage.VAE_DECODE):
                await asyncio.sleep(0)
            finished = True
            self.images_total += p.n
            yield ImagesDone(pixels, seed, timings)
        finally:
            self.running -= 1
            self.requests_total += 1
            if not finished:
                self.aborted.append(request.request_id)


def _preview(pixels: Pixels, step: int, steps: int, partials: int) -> tuple[Pixels | None, int]:
    """The preview on evenly spaced steps before the last: `partials` of them, darker copies."""
    if partials <= 0:
        return None, -1
    marks = [max(1, (i + 1) * steps // (partials + 1)) for i in range(partials)]
    if step not in marks or step == steps:
        return None, -1
    index = marks.index(step)
    return (pixels // (partials + 1 - index)).astype(np.uint8), index
