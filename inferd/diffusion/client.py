"""The image engine's asyncio front: the `ImageEngine` the gateway holds, one per image model.

    engine = await AsyncImageEngine.start(ImageEngineConfig(), env.cache_dir)
    async for event in engine.generate(ImageRequest("img-1", ImageParams("a red fox"))):
        ...
    await engine.drain(30.0); await engine.shutdown()
    await engine.add_style("ink", "/styles/ink")   # LoRA on: returns once read (400 if refused)
    await engine.remove_style("ink")               # False for an unknown name

`generate` checks the request against the model's limits on the event loop (InvalidRequestError
before anything is queued), queues it (QueueFullError with Retry-After at the bound) and then
yields what the engine thread sends. The thread hands each event to the loop with
`call_soon_threadsafe`, so the loop never blocks on the engine and the engine never waits on a
slow reader (a stream's events are small; previews are at most three per request). Closing the
iterator early aborts the request: it leaves at the next step boundary and its latents go.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch

from inferd.admission.timeouts import deadline_at
from inferd.config import ImageEngineConfig
from inferd.diffusion.engine import CoreLimits, ImageEngineCore, StyleCall
from inferd.diffusion.loader import ImageModelSpec, load_pipeline, resolve_image_model
from inferd.diffusion.lora import UNetStyles
from inferd.diffusion.request import (
    ImageEngineStats,
    ImageEvent,
    ImageLimits,
    ImageRequest,
    ImagesDone,
)
from inferd.diffusion.runner import ImageRunner
from inferd.diffusion.validate import MAX_N, resolve
from inferd.errors import DrainingError, InvalidRequestError
from inferd.lora.request import LoRARequest
from inferd.telemetry.stages import Stage

_Item = ImageEvent | BaseException
_DRAIN_POLL_S = 0.05


class AsyncImageEngine:
    """Implements inferd.diffusion.request.ImageEngine."""

    def __init__(
        self, core: ImageEngineCore, model_name: str, request_timeout_s: float | None = None
    ) -> None:
        self._core = core
        self._model_name = model_name
        self._request_timeout_s = request_timeout_s
        self._streams: dict[str, asyncio.Queue[_Item]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._draining = False

    @classmethod
    async def start(
        cls,
        config: ImageEngineConfig,
        cache_dir: Path,
        *,
        request_timeout_s: float | None = None,
    ) -> AsyncImageEngine:
        """Loads the model off the event loop and starts the engine thread."""
        core = await asyncio.to_thread(build_core, config, cache_dir)
        name = config.served_model_name or Path(config.image_model).name
        engine = cls(core, name, request_timeout_s)
        engine.run_in_thread()
        return engine

    def run_in_thread(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._core.set_emit(self._emit)
        self._thread = threading.Thread(
            target=self._core.run, name=f"image-engine-{self._model_name}", daemon=True
        )
        self._thread.start()

    # -- ImageEngine ---------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def limits(self) -> ImageLimits:
        return self._core.runner.parts.limits

    def styles(self) -> list[str]:
        return list(self._core.style_names)

    async def add_style(self, name: str, path: str) -> None:
        ids = (r.lora_int_id for r in await self._on_engine(lambda st: st.known()))
        request = LoRARequest(name, max(ids, default=0) + 1, path)
        await self._on_engine(lambda st: st.register(request))
        try:
            await asyncio.wrap_future(await self._on_engine(lambda st: st.load(name)))
        except Exception:
            await self._on_engine(lambda st: st.unregister(name))  # republishes the names
            raise

    async def remove_style(self, name: str) -> bool:
        removed: bool = await self._on_engine(lambda st: st.unregister(name))
        return removed

    async def _on_engine(self, fn: StyleCall) -> Any:
        return await asyncio.wrap_future(self._core.call(fn))

    def ready(self) -> bool:
        return not self._draining and self._thread is not None and self._thread.is_alive()

    def stats(self) -> ImageEngineStats:
        return self._core.stats()

    async def generate(self, request: ImageRequest) -> AsyncIterator[ImageEvent]:
        if self._draining:
            raise DrainingError("the server is shutting down")
        if request.request_id in self._streams:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running")
        with request.timings.measure(Stage.VALIDATE):
            spec = resolve(
                request.params,
                self.limits,
                max_rows=self._core.limits.max_rows_per_step,
                seed_source=secrets.randbits,
                styles=self.styles(),
            )
        request.deadline = _earliest(
            request.deadline, deadline_at(time.monotonic(), self._request_timeout_s, None)
        )
        stream: asyncio.Queue[_Item] = asyncio.Queue()
        self._core.add(request, spec)  # raises QueueFullError: nothing registered yet
        self._streams[request.request_id] = stream
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if isinstance(item, ImagesDone):
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                self._core.abort(request.request_id)

    # -- lifecycle -----------------------------------------------------------------------------

    async def drain(self, timeout_s: float) -> None:
        """Admits nothing new; waits up to `timeout_s` for what is queued or running."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while not self._core.idle() and time.monotonic() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)

    async def shutdown(self) -> None:
        """Stops the thread; whatever is left fails."""
        self._draining = True
        self._core.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    # -- from the engine thread ----------------------------------------------------------------

    def _emit(self, request_id: str, item: _Item) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed in between
                loop.call_soon_threadsafe(self._deliver, request_id, item)

    def _deliver(self, request_id: str, item: _Item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(item)


def build_core(config: ImageEngineConfig, cache_dir: Path) -> ImageEngineCore:
    """Resolves, loads and wraps one image model (blocking: seconds for a real model)."""
    if config.image_threads is not None:
        torch.set_num_threads(config.image_threads)
    folder = resolve_image_model(config.image_model, cache_dir)
    spec = ImageModelSpec(
        scheduler=config.image_scheduler,
        dtype=config.image_dtype,
        device=config.image_device,
        default_steps=config.image_default_steps,
        max_steps=config.image_max_steps,
        max_image_size=config.max_image_size,
        max_n=min(MAX_N, config.max_image_rows_per_step // 2),
    )
    parts = load_pipeline(folder, spec)
    runner = ImageRunner(parts, config.max_image_decode_rows)
    limits = CoreLimits(
        max_rows_per_step=config.max_image_rows_per_step,
        max_admitted=config.max_admitted_image_requests,
        max_queued_requests=config.max_queued_image_requests,
        max_decode_rows=config.max_image_decode_rows,
    )
    styles = UNetStyles(parts.unet, config.lora) if config.lora.enable_lora else None
    return ImageEngineCore(runner, limits, styles)


def _earliest(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else min(a, b)
