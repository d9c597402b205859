"""The image engine against diffusers' own StableDiffusionPipeline on inferd-tiny-sd.

Every image the engine makes, alone or sharing UNet forwards with other requests at other
timesteps, step counts, guidance scales, seeds, negative prompts and sizes, equals the image
`StableDiffusionPipeline` (`StableDiffusionXLPipeline` on inferd-tiny-sdxl) makes for that
request alone with
`generator=torch.Generator("cpu").manual_seed(seed)` (and `num_images_per_prompt=n`), within 3/255
per pixel. Also: cancellation mid-denoise frees the request's slot, deadlines (queued and while
denoising), the queue bound, bad input refused before queueing, a failing forward failing only
its own requests, a dead loop failing what it held, and a higher priority overtaking at a step
boundary. About 15 s on 2 busy cores.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import pytest
import torch

from inferd.config import ImageEngineConfig
from inferd.diffusion.client import AsyncImageEngine, build_core
from inferd.diffusion.request import (
    DenoiseProgress,
    ImageEvent,
    ImageParams,
    ImageRequest,
    ImagesDone,
)
from inferd.diffusion.tiny import ensure_tiny_sd
from inferd.diffusion.validate import ImageSpec, resolve
from inferd.errors import (
    DeadlineExceededError,
    EngineDeadError,
    InferdError,
    InvalidRequestError,
    QueueFullError,
    QueueTimeoutError,
)

diffusers = pytest.importorskip("diffusers")

SCHEDULERS = {
    "ddim": "DDIMScheduler",
    "euler": "EulerDiscreteScheduler",
    "dpmpp": "DPMSolverMultistepScheduler",
}
TOLERANCE = 3  # levels of 255
T = TypeVar("T")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@functools.cache
def _pipeline(folder: Path) -> Any:
    if "sdxl" in folder.name:
        pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(
            folder, use_safetensors=True, add_watermarker=False
        )
    else:
        pipe = diffusers.StableDiffusionPipeline.from_pretrained(
            folder, use_safetensors=True, safety_checker=None, requires_safety_checker=False
        )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference(folder: Path, scheduler: str, params: ImageParams) -> npt.NDArray[np.float32]:
    """diffusers' image(s) for one request alone, float32 in [0, 1], [n, H, W, 3]."""
    pipe = _pipeline(folder)
    pipe.scheduler = getattr(diffusers, scheduler).from_config(pipe.scheduler.config)
    out = pipe(
        params.prompt,
        negative_prompt=params.negative_prompt or None,
        num_inference_steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale,
        width=params.width or 64,
        height=params.height or 64,
        num_images_per_prompt=params.n,
        generator=torch.Generator("cpu").manual_seed(params.seed or 0),
        output_type="np",
    )
    images: npt.NDArray[np.float32] = out.images
    return images


def assert_same(images: npt.NDArray[np.uint8], expected: npt.NDArray[np.float32]) -> None:
    assert images.shape == expected.shape
    diff = np.abs(images.astype(np.float32) - expected * 255.0).max()
    assert diff <= TOLERANCE, f"max pixel difference {diff:.2f}/255"


def config(scheduler: str, **kw: Any) -> ImageEngineConfig:
    return ImageEngineConfig(image_scheduler=scheduler, **kw)  # type: ignore[arg-type]


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def started(cfg: ImageEngineConfig, cache_dir: Path) -> AsyncImageEngine:
    return await AsyncImageEngine.start(cfg, cache_dir)


async def collect(
    engine: AsyncImageEngine,
    request: ImageRequest,
    on_step: Callable[[DenoiseProgress], None] | None = None,
) -> tuple[ImagesDone, list[DenoiseProgress]]:
    progress: list[DenoiseProgress] = []
    async for event in engine.generate(request):
        if isinstance(event, ImagesDone):
            return event, progress
        progress.append(event)
        if on_step is not None:
            on_step(event)
    raise AssertionError("no ImagesDone")


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_alone_equals_diffusers(name: str, cache_dir: Path, folder: Path) -> None:
    params = ImageParams(
        "a red fox in the snow", num_inference_steps=6, guidance_scale=7.5, seed=11, n=2
    )

    async def main() -> tuple[ImagesDone, list[DenoiseProgress]]:
        engine = await started(config(SCHEDULERS[name]), cache_dir)
        try:
            return await collect(engine, ImageRequest("r", params))
        finally:
            await engine.shutdown()

    done, progress = run(main())
    assert [p.step for p in progress] == [1, 2, 3, 4, 5, 6]
    assert done.seed == 11 and done.images.dtype == np.uint8
    assert_same(done.images, reference(folder, SCHEDULERS[name], params))
    assert {"queue", "text_encode", "denoise", "vae_decode"} <= set(done.timings.as_dict())


MIXED = [
    ImageParams("a castle at night", num_inference_steps=9, guidance_scale=7.5, seed=1),
    ImageParams("a blue bird", "blurry", num_inference_steps=5, guidance_scale=4.0, seed=2, n=2),
    ImageParams("old tree", num_inference_steps=7, guidance_scale=1.0, seed=3),  # no guidance
    ImageParams("city street", num_inference_steps=6, guidance_scale=6.0, seed=4, width=80),
    ImageParams("a dragon", "dark", num_inference_steps=8, guidance_scale=7.5, seed=5, height=48),
]


async def staggered(
    cfg: ImageEngineConfig, cache_dir: Path, params: list[ImageParams], join_at: int
) -> tuple[list[ImagesDone], int]:
    """Runs `params` on one engine, each request starting when the one before it reached step
    `join_at`, so forwards mix rows at different timesteps. Returns the results and the number
    of UNet forwards."""
    engine = await started(cfg, cache_dir)
    try:
        gates = [asyncio.Event() for _ in params]
        gates[0].set()

        async def one(i: int) -> ImagesDone:
            await gates[i].wait()

            def on_step(p: DenoiseProgress) -> None:
                if p.step == join_at and i + 1 < len(gates):
                    gates[i + 1].set()

            return (await collect(engine, ImageRequest(f"m{i}", params[i]), on_step))[0]

        results = await asyncio.gather(*(one(i) for i in range(len(params))))
        return list(results), engine.stats().unet_forwards_total
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("name", ["euler", "dpmpp"])
def test_mixed_concurrent_requests_each_equal_diffusers(
    name: str, cache_dir: Path, folder: Path
) -> None:
    """Requests join at staggered steps, so forwards mix rows at different timesteps, step
    counts, guidance and sizes."""
    cfg = config(SCHEDULERS[name], max_image_rows_per_step=16)
    results, forwards = run(staggered(cfg, cache_dir, MIXED, join_at=2))
    assert forwards < sum(p.num_inference_steps for p in MIXED)  # they shared forwards
    for params, done in zip(MIXED, results, strict=True):
        assert_same(done.images, reference(folder, SCHEDULERS[name], params))


SDXL_MIXED = [
    ImageParams("a castle", num_inference_steps=6, guidance_scale=7.5, seed=1),  # zeros negative
    ImageParams("a bird", "blurry", num_inference_steps=4, guidance_scale=5.0, seed=2, n=2),
    ImageParams("a tree", num_inference_steps=5, guidance_scale=1.0, seed=3),
]


def test_sdxl_mixed_requests_each_equal_diffusers(cache_dir: Path) -> None:
    """SDXL's added conditioning (pooled text, size ids) rides along per row; an empty negative
    prompt is zeros (force_zeros_for_empty_prompt), as in diffusers."""
    folder = ensure_tiny_sd(cache_dir, "inferd-tiny-sdxl")
    cfg = config("EulerDiscreteScheduler", image_model="inferd-tiny-sdxl")
    results, forwards = run(staggered(cfg, cache_dir, SDXL_MIXED, join_at=1))
    assert forwards < sum(p.num_inference_steps for p in SDXL_MIXED)
    for params, done in zip(SDXL_MIXED, results, strict=True):
        assert_same(done.images, reference(folder, "EulerDiscreteScheduler", params))


def test_previews_and_progress(cache_dir: Path) -> None:
    params = ImageParams("a fox", num_inference_steps=8, seed=7, partial_images=3)

    async def main() -> list[DenoiseProgress]:
        engine = await started(config("EulerDiscreteScheduler"), cache_dir)
        try:
            return (await collect(engine, ImageRequest("p", params)))[1]
        finally:
            await engine.shutdown()

    progress = run(main())
    previews = [p for p in progress if p.preview is not None]
    assert [p.partial_index for p in previews] == [0, 1, 2]
    assert [p.step for p in previews] == [2, 4, 6]
    assert all(p.preview is not None and p.preview.shape == (1, 64, 64, 3) for p in previews)


async def _first_step(agen: AsyncIterator[ImageEvent]) -> ImageEvent:
    return await agen.__anext__()


def test_cancel_mid_denoise_frees_the_slot(cache_dir: Path) -> None:
    """One admitted request at a time: a closed stream must leave room for the next."""
    cfg = config("DDIMScheduler", max_admitted_image_requests=1)

    async def main() -> None:
        engine = await started(cfg, cache_dir)
        try:
            long = ImageRequest("long", ImageParams("a fox", num_inference_steps=150, seed=1))
            stream = engine.generate(long)
            first = await _first_step(stream)
            assert isinstance(first, DenoiseProgress) and first.step == 1
            await stream.aclose()  # type: ignore[attr-defined]
            short = ImageRequest("short", ImageParams("a cat", num_inference_steps=3, seed=2))
            done, _ = await collect(engine, short)
            assert done.images.shape == (1, 64, 64, 3)
            stats = engine.stats()
            assert stats.running == 0 and stats.waiting == 0
            assert stats.denoise_steps_total < 150
        finally:
            await engine.shutdown()

    run(main())


def test_a_higher_priority_request_overtakes_at_a_step_boundary(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row budget of one guided image: the running low-priority request pauses (latents
    kept) while the urgent one runs, then finishes its own steps. The engine holds its second
    forward until the urgent request is queued, so the order does not depend on timing."""
    cfg = config("DDIMScheduler", max_image_rows_per_step=2)

    async def main() -> list[str]:
        engine = await started(cfg, cache_dir)
        core, runner = engine._core, engine._core.runner
        queued = threading.Event()
        add, forward = core.add, runner.unet_forward
        forwards = itertools.count()

        def add_then_signal(request: ImageRequest, spec: ImageSpec) -> None:
            add(request, spec)
            queued.set()

        def gated(*args: Any) -> torch.Tensor:
            if next(forwards) == 1:
                assert queued.wait(60)
            return forward(*args)

        monkeypatch.setattr(core, "add", add_then_signal)
        monkeypatch.setattr(runner, "unet_forward", gated)
        finished: list[str] = []
        try:
            low = ImageRequest("low", ImageParams("a", num_inference_steps=8, seed=1), priority=5)
            urgent = ImageRequest("urgent", ImageParams("b", num_inference_steps=3, seed=2))

            async def one(request: ImageRequest) -> None:
                await collect(engine, request)
                finished.append(request.request_id)

            await asyncio.gather(one(low), one(urgent))
            assert engine.stats().denoise_steps_total == 11  # each step ran once, none lost
            return finished
        finally:
            await engine.shutdown()

    assert run(main()) == ["urgent", "low"]


def test_deadlines(cache_dir: Path) -> None:
    async def main() -> None:
        engine = await started(config("DDIMScheduler"), cache_dir)
        try:
            past = ImageRequest("late", ImageParams("a", num_inference_steps=3), deadline=0.0)
            with pytest.raises(QueueTimeoutError):
                await collect(engine, past)
            running = ImageRequest("run", ImageParams("b", num_inference_steps=150, seed=1))

            def expire(p: DenoiseProgress) -> None:
                running.deadline = time.monotonic()

            with pytest.raises(DeadlineExceededError, match="deadline passed after"):
                await collect(engine, running, expire)
            assert engine.stats().running == 0
        finally:
            await engine.shutdown()

    run(main())


def test_queue_full_and_bad_input(cache_dir: Path) -> None:
    cfg = config("DDIMScheduler", max_queued_image_requests=1)
    core = build_core(cfg, cache_dir)  # no thread: whatever is added stays queued
    limits = core.runner.parts.limits

    def spec(params: ImageParams) -> Any:
        return resolve(params, limits, max_rows=32, seed_source=lambda bits: 5)

    core.add(ImageRequest("a", ImageParams("x")), spec(ImageParams("x")))
    with pytest.raises(QueueFullError) as err:
        core.add(ImageRequest("b", ImageParams("y")), spec(ImageParams("y")))
    assert err.value.retry_after >= 1
    for bad in (
        ImageParams("x", width=60),  # not a multiple of 8
        ImageParams("x", height=4096),  # over the model's size
        ImageParams("x", num_inference_steps=1000),
        ImageParams("x", n=11),
        ImageParams("x", n=0),
        ImageParams("x", partial_images=4),
        ImageParams("x", guidance_scale=float("nan")),
    ):
        with pytest.raises(InvalidRequestError):
            spec(bad)
    assert core.stats().waiting == 1


def test_a_failing_forward_fails_only_its_requests(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward that raises fails the requests it ran (one size here); the other size's
    request, in forwards of its own, still gets its image."""

    async def main() -> None:
        engine = await started(config("DDIMScheduler"), cache_dir)
        runner = engine._core.runner
        forward = runner.unet_forward

        def flaky(
            sample: torch.Tensor,
            steps: torch.Tensor,
            embeds: torch.Tensor,
            added: dict[str, torch.Tensor] | None = None,
        ) -> torch.Tensor:
            if sample.shape[-1] == 6:  # 48-pixel-wide latents
                raise RuntimeError("out of memory (injected)")
            return forward(sample, steps, embeds, added)

        monkeypatch.setattr(runner, "unet_forward", flaky)
        try:
            bad = ImageRequest("bad", ImageParams("a", num_inference_steps=4, width=48))
            good = ImageRequest("good", ImageParams("b", num_inference_steps=4, seed=3))
            results = await asyncio.gather(
                collect(engine, bad), collect(engine, good), return_exceptions=True
            )
            assert isinstance(results[0], InferdError) and "injected" in str(results[0])
            assert isinstance(results[1], tuple) and results[1][0].images.shape == (1, 64, 64, 3)
            assert engine.ready()
        finally:
            await engine.shutdown()

    run(main())


def test_a_dead_loop_fails_what_it_held_and_refuses_more(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = build_core(config("DDIMScheduler"), cache_dir)
    errors: list[BaseException] = []
    core.set_emit(lambda rid, item: errors.append(item) if isinstance(item, Exception) else None)
    spec = resolve(ImageParams("x"), core.runner.parts.limits, max_rows=32, seed_source=int)
    core.add(ImageRequest("queued", ImageParams("x")), spec)

    def broken() -> None:
        raise RuntimeError("a bug in the loop")

    monkeypatch.setattr(core, "step", broken)
    core.run()  # logs the error and returns: readiness (the thread alive) turns red
    assert len(errors) == 1 and isinstance(errors[0], EngineDeadError)
    with pytest.raises(EngineDeadError):
        core.add(ImageRequest("later", ImageParams("x")), spec)
