"""OpenAI's Images API as pydantic models: the `POST /v1/images/generations` body (with
vLLM-Omni's extras `negative_prompt`, `num_inference_steps`, `guidance_scale`, `seed`) and the
response, as /openapi.json declares them.

Schema checks (types, ranges the API itself fixes: `n` >= 1, `partial_images` 0-3,
`output_compression` 0-100) happen at parse time; the model's own limits (sizes, steps, `n`)
are the engine's to check (`ImageLimits`), before anything is queued.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, StrictBool, StrictFloat, StrictStr

from inferd.diffusion.request import ImageParams
from inferd.gateway.contract import OpenModel
from inferd.gateway.errors import bad_request
from inferd.gateway.openai.protocol import JsonInt, _Body
from inferd.postprocess.image_encode import ImageFormat

_SIZE = re.compile(r"([1-9][0-9]{0,5})x([1-9][0-9]{0,5})")
# Seeds are what torch.Generator.manual_seed takes without wrapping: a non-negative int64.
_MAX_SEED = 2**63 - 1


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
    output_compression: JsonInt | None = Field(default=None, ge=0, le=100)
    background: Literal["auto", "opaque", "transparent"] | None = None
    stream: StrictBool = False
    partial_images: JsonInt | None = Field(default=None, ge=0, le=3)
    negative_prompt: StrictStr = ""
    num_inference_steps: JsonInt | None = Field(default=None, ge=1)
    guidance_scale: StrictFloat | JsonInt | None = Field(default=None, ge=0)
    seed: JsonInt | None = Field(default=None, ge=0, le=_MAX_SEED)
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
            guidance_scale=None if self.guidance_scale is None else float(self.guidance_scale),
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
