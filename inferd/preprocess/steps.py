"""Pre- and postprocessing steps, built from a model's config.yaml.

    preprocess:
      - {type: tokenize, tokenizer: tokenizer.json, max_length: 256}
    postprocess:
      - {type: mean_pool, input: token_embeddings, output: embedding, normalize: true}

    steps = build_steps(config.preprocess, stage="preprocess", model_dir=d, version_dir=d / "1")
    tensors = steps[0]({"text": np.array([[b"hello"]], dtype=object)})

Step types (options: each module's `*Options` class):
    preprocess   tokenize (text.py), image (image.py), audio_mfcc (audio.py)
    postprocess  softmax, l2_normalize (inferd/postprocess/tensor_ops.py),
                 mean_pool (pooling.py), nms (nms.py)

A bad spec fails the model's load with ModelConfigError naming the field
("preprocess[0].size: ..."); bad request data fails that request with InvalidRequestError.
Relative file paths resolve against the version folder first, then the model folder.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from inferd.errors import InvalidRequestError, ModelConfigError
from inferd.tensors import Step

StageName = Literal["preprocess", "postprocess"]


class StepOptions(BaseModel):
    """Base of every step's options: unknown keys are errors, so a typo cannot be ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    type: str


@dataclass(frozen=True)
class StepContext:
    stage: StageName
    where: str  # "preprocess[0]": the prefix of every message about this step
    model_dir: Path
    version_dir: Path

    def resolve(self, name: str, field: str) -> Path:
        """A file named in the spec: absolute, or relative to version_dir, then model_dir."""
        path = Path(name)
        candidates = (
            [path] if path.is_absolute() else [self.version_dir / path, self.model_dir / path]
        )
        for candidate in candidates:
            if candidate.is_file():
                return candidate
        raise ModelConfigError(
            f"{self.where}.{field}: no file {name!r} (looked in {', '.join(map(str, candidates))})"
        )

    def take(self, tensors: Mapping[str, np.ndarray], name: str) -> np.ndarray:
        """The tensor `name`, or an error for the side at fault: a missing client input is the
        request's (400); a model output missing in postprocess is the config's."""
        array = tensors.get(name)
        if array is not None:
            return array
        message = f"{self.where}: needs tensor {name!r}; have {sorted(tensors)}"
        if self.stage == "preprocess":
            raise InvalidRequestError(message, name)
        raise ModelConfigError(message)

    def take_rows(self, tensors: Mapping[str, np.ndarray], name: str, what: str) -> np.ndarray:
        """A BYTES input holding one `what` (an encoded image, a text, a WAV file) per row:
        shape [n] or [n, 1], returned flat."""
        array = self.take(tensors, name)
        if array.ndim > 2 or (array.ndim == 2 and array.shape[1] != 1):
            raise InvalidRequestError(
                f"input {name!r}: expected shape [n] or [n, 1] (one {what} per row), got "
                f"{list(array.shape)}",
                name,
            )
        return array.reshape(-1)


Factory = Callable[[Any, StepContext], Step]


def _registry() -> dict[str, tuple[StageName, type[StepOptions], Factory]]:
    # Imported here: the step modules import this one (StepOptions, StepContext), and a model
    # only pays for the libraries (Pillow, scipy, tokenizers) of the steps it uses... once.
    from inferd.postprocess import nms, pooling, tensor_ops
    from inferd.preprocess import audio, image, text

    return {
        "tokenize": ("preprocess", text.TokenizeOptions, text.TokenizeStep),
        "image": ("preprocess", image.ImageOptions, image.ImageStep),
        "audio_mfcc": ("preprocess", audio.AudioMfccOptions, audio.AudioMfccStep),
        "softmax": ("postprocess", tensor_ops.SoftmaxOptions, tensor_ops.SoftmaxStep),
        "l2_normalize": ("postprocess", tensor_ops.L2NormalizeOptions, tensor_ops.L2NormalizeStep),
        "mean_pool": ("postprocess", pooling.MeanPoolOptions, pooling.MeanPoolStep),
        "nms": ("postprocess", nms.NmsOptions, nms.NmsStep),
    }


def build_steps(
    specs: Sequence[Mapping[str, Any]],
    *,
    stage: StageName,
    model_dir: Path,
    version_dir: Path,
) -> list[Step]:
    """One Step per spec, in order. Raises ModelConfigError naming the bad field."""
    registry = _registry()
    return [
        _build_one(spec, StepContext(stage, f"{stage}[{i}]", model_dir, version_dir), registry)
        for i, spec in enumerate(specs)
    ]


def _build_one(
    spec: Mapping[str, Any],
    ctx: StepContext,
    registry: Mapping[str, tuple[StageName, type[StepOptions], Factory]],
) -> Step:
    if not isinstance(spec, Mapping):
        raise ModelConfigError(f"{ctx.where}: a step is a mapping with a `type`, got {spec!r}")
    kind = spec.get("type")
    allowed = sorted(name for name, entry in registry.items() if entry[0] == ctx.stage)
    if not isinstance(kind, str) or kind not in registry:
        raise ModelConfigError(f"{ctx.where}.type: {kind!r} is not a step type; one of {allowed}")
    step_stage, options_cls, factory = registry[kind]
    if step_stage != ctx.stage:
        raise ModelConfigError(
            f"{ctx.where}.type: {kind!r} is a {step_stage} step; {ctx.stage} steps: {allowed}"
        )
    try:
        options = options_cls.model_validate(dict(spec))
    except ValidationError as e:
        raise ModelConfigError(_describe(ctx.where, e)) from e
    return factory(options, ctx)


def _describe(where: str, error: ValidationError) -> str:
    """`preprocess[0].size: List should have at least 2 items` (every problem, `; `-joined)."""
    parts = []
    for problem in error.errors():
        field = ".".join(str(p) if isinstance(p, str) else f"[{p}]" for p in problem["loc"])
        parts.append(f"{where}.{field.replace('.[', '[')}: {problem['msg']}")
    return "; ".join(parts)
