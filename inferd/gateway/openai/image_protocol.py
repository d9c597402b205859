"""OpenAI's Images API as pydantic models: the `POST /v1/images/generations` body (with
vLLM-Omni's extras `negative_prompt`, `num_inference_steps`, `guidance_scale`, `seed`) and the
response, as /openapi.json declares them.

Schema checks (types, ranges the API itself fixes: `n` >= 1, `partial_images` 0-3,
`output_compression` 0-100) happen at parse time; the model's own limits (sizes, steps, `n`)
are the engine's to check (`ImageLimits`), before anything is queued.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from inferd.diffusion.request import ImageParams
from inferd.gateway.contract import OpenModel
from inferd.gateway.errors import bad_request
from inferd.gateway.openai.protocol import JsonInt, _Body, _integral
from inferd.postprocess.image_encode import ImageFormat

_SIZE = re.compile(r"([1-9][0-9]{0,5})x([1-9][0-9]{0,5})")
# Seeds are what torch.Generator.manual_seed takes without wrapping: a non-negative int64.
_MAX_SEED = 2**63 - 1


def _number(value: object) -> object:
    """2 -> 2.0: a JSON number without a fraction is still a number (true and "2" stay refused)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


# Optional numbers with bounds: the bounds stand before the validator, so /openapi.json states
# them as `minimum`/`maximum` (after it, pydantic writes them as keywords no validator knows).
Steps = Annotated[StrictInt, Field(ge=1), BeforeValidator(_integral)]
Percent = Annotated[StrictInt, Field(ge=0, le=100), BeforeValidator(_integral)]
PartialImages = Annotated[StrictInt, Field(ge=0, le=3), BeforeValidator(_integral)]
Seed = Annotated[StrictInt, Field(ge=0, le=_MAX_SEED), BeforeValidator(_integral)]
Guidance = Annotated[StrictFloat, Field(ge=0), BeforeValidator(_number)]


class ImageGenerationRequest(_Body):
    prompt: StrictStr = Field(min_length=1)
    model: StrictStr | None = None
    n: JsonInt = Field(default=1, ge=1)
    size: StrictStr = Field(default="auto", description='"WIDTHxHEIGHT" (e.g. "512x512") or "auto"')
    response_format: Literal["b64_json", "url", "file"] | None = Field(
        default=None,
        description='"b64_json" (the default), or "file": the raw bytes of the one image ("url" '
        "is refused: the server stores no images)",
    )
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: Percent | None = None
    background: Literal["auto", "opaque", "transparent"] | None = None
    stream: StrictBool = False
    partial_images: PartialImages | None = None
    negative_prompt: StrictStr = ""
    num_inference_steps: Steps | None = None
    guidance_scale: Guidance | None = None
    seed: Seed | None = None
    priority: JsonInt = 0

    def dimensions(self) -> tuple[int, int]:
        """(width, height); (0, 0) for "auto" (the model's default)."""
        if self.size == "auto":
            return 0, 0
        m = _SIZE.fullmatch(self.size)
        if m is None:
            raise bad_request(f'size must be "WIDTHxHEIGHT" or "auto", not {self.size!r}', "size")
        return int(m.group(1)), int(m.group(2))

    def params(self, lora_name: str | None) -> ImageParams:
        """The engine's parameters; raises a 400 for what the API itself refuses."""
        if self.response_format == "url":
            raise bad_request(
                'response_format "url" needs image storage, which inferd has none of: use '
                '"b64_json", or "file" (or an Accept: image/png header) for the raw bytes',
                "response_format",
            )
        if self.background == "transparent":
            raise bad_request("transparent backgrounds are not supported", "background")
        width, height = self.dimensions()
        return ImageParams(
            prompt=self.prompt,
            negative_prompt=self.negative_prompt,
            n=self.n,
            width=width,
            height=height,
            num_inference_steps=self.num_inference_steps or 0,
            guidance_scale=self.guidance_scale,
            seed=self.seed,
            lora_name=lora_name,
            partial_images=(self.partial_images or 0) if self.stream else 0,
        )

    @property
    def format(self) -> ImageFormat:
        return self.output_format


class ImageData(OpenModel):
    b64_json: str


class ImagesResponse(OpenModel):
    created: int
    data: list[ImageData]
    output_format: Literal["png", "jpeg", "webp"]
    size: str = Field(description='"WIDTHxHEIGHT" of the images')
    background: Literal["opaque"]
    seed: int = Field(description="The seed the images were drawn with (inferd's extension)")
    timings: dict[str, float] | None = Field(
        default=None, description="Seconds per request stage (inferd's extension)"
    )
