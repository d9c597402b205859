"""Image models on the Open Inference Protocol (KServe v2), over HTTP and gRPC alike.

An image model answers where a repository model does (`Catalog`: the image models first, then
the repository): the repository index, `/v2/models`, model metadata, config, ready, and infer.

    inputs:   prompt           BYTES  [1]  (or [1, 1])   required
              negative_prompt  BYTES  [1]                optional
              steps, n, width, height, seed  INT*  [1]   optional (0: the model's default)
              guidance         FP*    [1]                optional
    output:   image            UINT8  [n, height, width, 3]

The optional values may also come as request `parameters` (`{"steps": 20}`); an input wins.
Triton's `priority` (1 highest, larger later) is not the image queue's order (lower first, as on
the OpenAI route), so image requests over KServe run at the default priority.
A LoRA style is served under its own name (as on the OpenAI API). The whole generation runs
in one infer call; the binary extension (HTTP) or raw contents (gRPC) carry the pixels without
JSON's cost.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from inferd.diffusion.request import ImageEngine, ImageParams
from inferd.errors import InvalidRequestError, ModelNotFoundError, ModelNotReadyError
from inferd.gateway.images import (
    finalize_image_job,
    find_image_model,
    finish,
    new_image_job,
    start_image_job,
)
from inferd.gateway.state import GatewayState
from inferd.telemetry.request_log import log_id
from inferd.telemetry.stages import Stage
from inferd.tensors import InferRequest, InferResponse, OutputTensor

if TYPE_CHECKING:
    from inferd.batching.pipeline import ServedModel
    from inferd.repository.manager import ModelRepository

_anonymous = itertools.count(1)  # gRPC requests without an id
PLATFORM = "inferd_diffusion"
VERSION = "1"
_INTS = ("steps", "n", "width", "height", "seed")
_TEXTS = ("prompt", "negative_prompt")
_FLOATS = ("guidance",)


def _tensor(name: str, datatype: str, dims: list[int], optional: bool) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": dims, "optional": optional}


_INPUTS = [
    _tensor("prompt", "BYTES", [1], False),
    _tensor("negative_prompt", "BYTES", [1], True),
    *(_tensor(name, "INT64", [1], True) for name in _INTS),
    _tensor("guidance", "FP32", [1], True),
]
_OUTPUTS = [_tensor("image", "UINT8", [-1, -1, -1, 3], False)]


class ServedImageModel:
    """An image model (or one of its styles) with the served-model surface the KServe routes
    use: `version`, `ready`, `infer`."""

    version = VERSION

    def __init__(self, state: GatewayState, name: str, engine: ImageEngine, style: str | None):
        self.state, self.name, self.engine, self.style = state, name, engine, style

    @property
    def ready(self) -> bool:
        return self.engine.ready() and not self.state.draining

    def metadata(self) -> dict[str, Any]:
        strip = ("optional",)
        return {
            "name": self.name,
            "versions": [VERSION],
            "platform": PLATFORM,
            "inputs": [{k: v for k, v in t.items() if k not in strip} for t in _INPUTS],
            "outputs": [{k: v for k, v in t.items() if k not in strip} for t in _OUTPUTS],
        }

    def config(self) -> dict[str, Any]:
        """Triton's JSON model config."""

        def triton(t: dict[str, Any]) -> dict[str, Any]:
            kind = "TYPE_STRING" if t["datatype"] == "BYTES" else f"TYPE_{t['datatype']}"
            out = {"name": t["name"], "data_type": kind, "dims": t["shape"]}
            return out | ({"optional": True} if t["optional"] else {})

        return {
            "name": self.name,
            "platform": PLATFORM,
            "backend": "diffusers",
            "max_batch_size": 0,
            "input": [triton(t) for t in _INPUTS],
            "output": [triton(t) for t in _OUTPUTS],
            "parameters": {"base_model": self.engine.model_name, "style": self.style or ""},
        }

    async def infer(self, request: InferRequest) -> InferResponse:
        """One generation; its stages are recorded as an image request's (metrics, log)."""
        received = time.monotonic()
        arrival = request.arrival or received
        params = image_params(request, self.style)
        job = new_image_job(
            self.state,
            self.engine,
            params,
            log_id(request.id or f"kserve-{next(_anonymous)}"),
            arrival,
            received,
            timeout_s=request.timeout_us / 1e6 if request.timeout_us else None,
        )
        events = await start_image_job(self.state, job)
        try:
            done = await finish(job, events)
            job.outcome = "ok"
        finally:
            finalize_image_job(self.state, job)
        response = InferResponse(
            self.name,
            VERSION,
            request.id,
            [OutputTensor("image", done.images, "UINT8")],
            parameters={"seed": done.seed},
        )
        for stage, seconds in job.timeline.stages.seconds.items():
            if stage not in (Stage.RECEIVE, Stage.STREAM):
                response.timings.set(stage, seconds, job.timeline.stages.starts.get(stage))
        return response


def image_params(request: InferRequest, style: str | None) -> ImageParams:
    """The generation an infer request asks for; 400 for a missing prompt or wrong types."""
    values = dict(request.parameters)
    known = {*_TEXTS, *_INTS, *_FLOATS}
    for name, array in request.inputs.items():
        if name not in known:
            raise InvalidRequestError(f"unknown input {name!r} (inputs: {sorted(known)})", name)
        if array.size != 1:
            raise InvalidRequestError(f"input {name!r} must hold one value", name)
        values[name] = array.reshape(-1)[0]
    if "prompt" not in request.inputs:
        raise InvalidRequestError("the BYTES input 'prompt' is required", "prompt")
    return ImageParams(
        prompt=_text(values, "prompt"),
        negative_prompt=_text(values, "negative_prompt"),
        n=_int(values, "n") or 1,
        width=_int(values, "width"),
        height=_int(values, "height"),
        num_inference_steps=_int(values, "steps"),
        guidance_scale=_float(values, "guidance"),
        seed=_int(values, "seed") if "seed" in values else None,
        lora_name=style,
    )


def _text(values: dict[str, Any], name: str) -> str:
    value = values.get(name, "")
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            raise InvalidRequestError(f"{name!r} must be UTF-8 text", name) from None
    if isinstance(value, str):
        return value
    raise InvalidRequestError(f"{name!r} must be BYTES (text)", name)


def _int(values: dict[str, Any], name: str) -> int:
    value = values.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InvalidRequestError(f"{name!r} must be an integer", name)
    if int(value) < 0 and name != "seed":
        raise InvalidRequestError(f"{name!r} must not be negative", name)
    return int(value)


def _float(values: dict[str, Any], name: str) -> float | None:
    value = values.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise InvalidRequestError(f"{name!r} must be a number", name)
    return float(value)


class Catalog:
    """The image models and the model repository under one lookup: what every KServe route
    but load/unload/stats reads."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state

    def image(self, name: str) -> ServedImageModel | None:
        found = find_image_model(self.state, name)
        if found is None:
            return None
        return ServedImageModel(self.state, name, *found)

    def get(self, name: str, version: str = "") -> ServedModel | ServedImageModel:
        """A served model (repository or image); ModelNotFoundError / ModelNotReadyError."""
        image = self.image(name)
        if image is None:
            return self._repository().get(name, version)
        return self._image(image, name, version)

    def _image(self, image: ServedImageModel, name: str, version: str) -> ServedImageModel:
        if version and version != VERSION:
            raise ModelNotFoundError(f"model {name!r} has no version {version!r} (ready: ['1'])")
        if not image.ready:
            raise ModelNotReadyError(f"model {name!r} is not ready")
        return image

    def metadata(self, name: str, version: str = "") -> dict[str, Any]:
        image = self.image(name)
        if image is None:
            return self._repository().metadata(name, version)
        return self._image(image, name, version).metadata()

    def config_dict(self, name: str, version: str = "") -> dict[str, Any]:
        image = self.image(name)
        if image is None:
            return self._repository().config_dict(name, version)
        return self._image(image, name, version).config()

    def image_names(self) -> list[str]:
        names = []
        for name, engine in self.state.images.items():
            names += [name, *engine.styles()]
        return names

    def model_names(self) -> list[str]:
        """Ready models: the image models' names and styles, and the repository's."""
        repo = self.state.repository
        images = [n for n in self.image_names() if (m := self.image(n)) is not None and m.ready]
        return sorted([*images, *([] if repo is None else repo.model_names())])

    def index(self) -> list[dict[str, str]]:
        repo = self.state.repository
        entries = [
            {
                "name": name,
                "version": VERSION,
                "state": "READY" if image.ready else "UNAVAILABLE",
                "reason": "" if image.ready else "loading",
            }
            for name in self.image_names()
            if (image := self.image(name)) is not None
        ]
        return sorted([*entries, *([] if repo is None else repo.index())], key=lambda e: e["name"])

    def _repository(self) -> ModelRepository:
        repo = self.state.repository
        if repo is None:
            raise ModelNotFoundError(
                "unknown model (this server serves no model repository: start it with "
                "--model-repository DIR)"
            )
        return repo
