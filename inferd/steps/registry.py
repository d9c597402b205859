"""The step factory: a model's `preprocess:` / `postprocess:` specs -> Step objects.

    preprocess:
      - {type: tokenize, tokenizer: tokenizer.json, max_length: 256}
    postprocess:
      - {type: mean_pool, input: token_embeddings, output: embedding, normalize: true}

    steps = build_steps(config.preprocess, stage="preprocess", model_dir=d, version_dir=d / "1")
    tensors = steps[0]({"text": np.array([[b"hello"]], dtype=object)})

Step types (options: each module's `*Options` class):
    preprocess   tokenize (text.py), image (image.py), audio_mfcc (audio.py)
    postprocess  softmax, l2_normalize (tensor_ops.py), mean_pool (pooling.py), nms (nms.py)

The only module that imports the step modules (they import base.py, never each other).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from inferd.errors import ModelConfigError
from inferd.steps.base import StageName, Step, StepContext, StepOptions

Factory = Callable[[Any, StepContext], Step]


def _registry() -> dict[str, tuple[StageName, type[StepOptions], Factory]]:
    # Imported here, not at the top: a server that loads no step-using model never pays for
    # the libraries (Pillow, scipy, tokenizers) the step modules import.
    from inferd.steps import audio, image, nms, pooling, tensor_ops, text

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
