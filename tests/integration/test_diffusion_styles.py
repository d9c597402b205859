"""Many LoRA styles in one batch, through the image engine, against diffusers on inferd-tiny-sd.

Concurrent requests of style A, style B and no style, with different steps, seeds, guidance and
`n`, share UNet forwards; each image equals `StableDiffusionPipeline` with the style loaded by
`load_lora_weights(folder)` at scale 1 (or without LoRA) run alone with the same seed, within
3/255 per pixel. Also: a style read on first use (its `lora_load` time), run-time add/remove,
an unknown style a 404 before queueing, a refused file a 400. About 10 s on 2 busy cores.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from inferd.config import ImageEngineConfig, LoRAConfig, LoRAModule
from inferd.diffusion.client import AsyncImageEngine
from inferd.diffusion.random_style import write_random_style
from inferd.diffusion.request import ImageParams, ImageRequest, ImagesDone
from inferd.errors import InvalidRequestError, ModelNotFoundError

diffusers = pytest.importorskip("diffusers")

SCHEDULER = "EulerDiscreteScheduler"
TOLERANCE = 3  # levels of 255
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
MIXED = [
    ("ink", ImageParams("a castle", num_inference_steps=6, guidance_scale=7.5, seed=1)),
    (
        "oil",
        ImageParams("a bird", "blurry", num_inference_steps=5, guidance_scale=4.0, seed=2, n=2),
    ),
    (None, ImageParams("a tree", num_inference_steps=7, guidance_scale=7.5, seed=3)),
    ("ink", ImageParams("a street", num_inference_steps=4, guidance_scale=1.0, seed=4)),
    ("oil", ImageParams("a dragon", num_inference_steps=6, guidance_scale=6.0, seed=5)),
]


@pytest.fixture(scope="module")
def styles(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("styles")
    return {
        "ink": write_random_style(folder, root / "ink", rank=4, seed=1),
        "oil": write_random_style(
            folder, root / "oil", rank=2, seed=2, targets=("to_k", "ff.net.2")
        ),
    }


def reference(folder: Path, style: Path | None, params: ImageParams) -> npt.NDArray[np.float32]:
    """diffusers' images for one request alone, float32 in [0, 1]."""
    pipe: Any = diffusers.StableDiffusionPipeline.from_pretrained(
        folder, use_safetensors=True, safety_checker=None, requires_safety_checker=False
    )
    pipe.scheduler = getattr(diffusers, SCHEDULER).from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    if style is not None:
        pipe.load_lora_weights(style)
    out = pipe(
        params.prompt,
        negative_prompt=params.negative_prompt or None,
        num_inference_steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale,
        width=64,
        height=64,
        num_images_per_prompt=params.n,
        generator=torch.Generator("cpu").manual_seed(params.seed or 0),
        output_type="np",
    )
    images: npt.NDArray[np.float32] = out.images
    return images


def max_diff(images: npt.NDArray[np.uint8], expected: npt.NDArray[np.float32]) -> float:
    assert images.shape == expected.shape
    return float(np.abs(images.astype(np.float32) - expected * 255.0).max())


def engine_config(lora: LoRAConfig) -> ImageEngineConfig:
    return ImageEngineConfig(image_scheduler=SCHEDULER, max_image_rows_per_step=16, lora=lora)  # type: ignore[arg-type]


async def generate(engine: AsyncImageEngine, rid: str, params: ImageParams) -> ImagesDone:
    async for event in engine.generate(ImageRequest(rid, params)):
        if isinstance(event, ImagesDone):
            return event
    raise AssertionError("no ImagesDone")


def test_styles_and_no_style_share_forwards_each_equal_diffusers(
    cache_dir: Path, folder: Path, styles: dict[str, Path]
) -> None:
    """ "ink" from --lora-modules (read on first use), "oil" added at run time."""
    lora = LoRAConfig(
        enable_lora=True,
        lora_modules=(LoRAModule(name="ink", path=str(styles["ink"])),),
        max_loras=2,
    )

    async def main() -> tuple[list[ImagesDone], int]:
        engine = await AsyncImageEngine.start(engine_config(lora), cache_dir)
        try:
            await engine.add_style("oil", str(styles["oil"]))
            assert engine.styles() == ["ink", "oil"]
            jobs = [
                generate(engine, f"r{i}", dataclasses.replace(p, lora_name=style))
                for i, (style, p) in enumerate(MIXED)
            ]
            done = await asyncio.gather(*jobs)
            return list(done), engine.stats().unet_forwards_total
        finally:
            await engine.shutdown()

    results, forwards = asyncio.run(main())
    assert forwards < sum(p.num_inference_steps for _, p in MIXED)  # they shared forwards
    assert "lora_load" in results[0].timings.as_dict()  # ink was read on first use
    for (style, params), done in zip(MIXED, results, strict=True):
        expected = reference(folder, None if style is None else styles[style], params)
        assert max_diff(done.images, expected) <= TOLERANCE, (style, params.seed)
    # The style changes the image (the same request without it is another image).
    assert max_diff(results[0].images, reference(folder, None, MIXED[0][1])) > 3 * TOLERANCE


def test_unknown_refused_and_removed_styles(
    cache_dir: Path, tmp_path: Path, styles: dict[str, Path]
) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "pytorch_lora_weights.safetensors").write_bytes(b"not a safetensors file")
    lora = LoRAConfig(enable_lora=True, lora_modules=(LoRAModule(name="bad", path=str(bad)),))

    async def main() -> None:
        engine = await AsyncImageEngine.start(engine_config(lora), cache_dir)
        try:
            params = ImageParams("a fox", num_inference_steps=2, seed=1)
            styled = dataclasses.replace(params, lora_name="ink")
            with pytest.raises(ModelNotFoundError):  # before anything is queued
                await generate(engine, "u", dataclasses.replace(params, lora_name="nope"))
            with pytest.raises(InvalidRequestError, match="could not be read"):
                await generate(engine, "b", dataclasses.replace(params, lora_name="bad"))
            assert "bad" not in engine.styles()  # a refused file is unregistered
            with pytest.raises(InvalidRequestError, match="could not be read"):
                await engine.add_style("bad2", str(bad))
            assert engine.styles() == []
            await engine.add_style("ink", str(styles["ink"]))
            ink = asyncio.ensure_future(generate(engine, "i", styled))
            await asyncio.sleep(0)  # queued: it runs under "ink" although removed meanwhile
            assert await engine.remove_style("ink")  # the running request finishes first
            assert not await engine.remove_style("ink")
            assert (await ink).images.shape == (1, 64, 64, 3)
            with pytest.raises(ModelNotFoundError):
                await generate(engine, "j", styled)
            assert (await generate(engine, "k", params)).images.shape == (1, 64, 64, 3)
        finally:
            await engine.shutdown()

    asyncio.run(main())
