"""A request's parameters against the model's limits, before anything is queued (pure Python).

    spec = resolve(params, limits, max_rows=32, seed_source=secrets.randbits)
    spec.width, spec.height, spec.steps, spec.guidance_scale, spec.seed, spec.rows

Zero sizes and steps and a None guidance take the model's defaults (`ImageLimits`); a None seed
is drawn, so every image can be reproduced from the seed `ImagesDone` reports. Anything out of
range is an `InvalidRequestError` naming the parameter (HTTP 400), and an unknown style a
`ModelNotFoundError` (404).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass

from inferd.diffusion.request import ImageLimits, ImageParams
from inferd.errors import InvalidRequestError, ModelNotFoundError

MAX_N = 10  # images a request, OpenAI's bound
MAX_PARTIAL_IMAGES = 3  # OpenAI's bound
SEED_BITS = 63  # torch.Generator.manual_seed takes any int64 >= 0
MAX_GUIDANCE = 100.0


@dataclass(frozen=True, slots=True)
class ImageSpec:
    """An `ImageParams` with every default filled in and every bound checked."""

    prompt: str
    negative_prompt: str
    n: int
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int
    lora_name: str | None
    partial_images: int

    @property
    def cfg(self) -> bool:
        """Classifier-free guidance runs (uncond + cond rows) when the scale is above 1, as in
        diffusers' pipeline."""
        return self.guidance_scale > 1.0

    @property
    def rows(self) -> int:
        return self.n * (2 if self.cfg else 1)


def resolve(
    params: ImageParams,
    limits: ImageLimits,
    *,
    max_rows: int,
    seed_source: Callable[[int], int],
    styles: Collection[str] = (),
) -> ImageSpec:
    """The checked spec, or InvalidRequestError / ModelNotFoundError."""
    width = _side(params.width or limits.default_width, limits.max_width, limits, "width")
    height = _side(params.height or limits.default_height, limits.max_height, limits, "height")
    steps = params.num_inference_steps or limits.default_steps
    _in_range("num_inference_steps", steps, 1, limits.max_steps)
    _in_range("n", params.n, 1, limits.max_n)
    _in_range("partial_images", params.partial_images, 0, MAX_PARTIAL_IMAGES)
    guidance = limits.default_guidance_scale
    if params.guidance_scale is not None:
        guidance = params.guidance_scale
    if not (math.isfinite(guidance) and 0.0 <= guidance <= MAX_GUIDANCE):
        raise InvalidRequestError(
            f"guidance_scale must be in [0, {MAX_GUIDANCE:g}], got {guidance}", "guidance_scale"
        )
    seed = seed_source(SEED_BITS) if params.seed is None else params.seed
    _in_range("seed", seed, 0, 2**SEED_BITS - 1)
    if params.lora_name is not None and params.lora_name not in styles:
        raise ModelNotFoundError(f"the style {params.lora_name!r} does not exist")
    spec = ImageSpec(
        prompt=params.prompt,
        negative_prompt=params.negative_prompt,
        n=params.n,
        width=width,
        height=height,
        steps=steps,
        guidance_scale=guidance,
        seed=seed,
        lora_name=params.lora_name,
        partial_images=params.partial_images,
    )
    if spec.rows > max_rows:
        raise InvalidRequestError(
            f"n={spec.n} needs {spec.rows} UNet rows a step; this server runs at most {max_rows}",
            "n",
        )
    return spec


def _side(value: int, maximum: int, limits: ImageLimits, param: str) -> int:
    multiple = limits.size_multiple
    if value <= 0 or value % multiple:
        raise InvalidRequestError(f"{param} must be a positive multiple of {multiple}", "size")
    if value > maximum:
        raise InvalidRequestError(f"{param} {value} is over this model's {maximum}", "size")
    return value


def _in_range(param: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise InvalidRequestError(f"{param} must be in [{low}, {high}], got {value}", param)
