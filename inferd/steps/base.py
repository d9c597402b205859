"""What every pre- and postprocessing step is built from: the Step protocol, the options base
and the context a step reads its files and tensors through.

Every step module (text.py, image.py, ...) imports this module and nothing else of inferd's
but `inferd.errors`; only registry.py imports the step modules. So a step module is a leaf:
`import inferd.steps.nms` costs numpy and pydantic, never `tokenizers` or Pillow.

A bad spec fails the model's load with ModelConfigError naming the field
("preprocess[0].size: ..."); bad request data fails that request with InvalidRequestError.
Relative file paths resolve against the version folder first, then the model folder.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict

from inferd.errors import InvalidRequestError, ModelConfigError

StageName = Literal["preprocess", "postprocess"]

L2_EPS = 1e-12  # torch.nn.functional.normalize's default eps


class Step(Protocol):
    """One pre- or postprocessing step, run per request (rows of that request only).

    Preprocess: the request's validated client tensors in, the model's input tensors out.
    Postprocess: that request's rows of the model outputs, merged with its (padded)
    preprocessed inputs (so pooling can see attention_mask), in; the client outputs out.
    A step returns a new dict: tensors it does not consume pass through unchanged.
    Raises inferd.errors.InvalidRequestError for bad input (the request fails alone, 400).
    """

    stage: str  # "preprocess" or "postprocess": which stage histogram its time goes to

    def __call__(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


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


def l2_normalize(x: np.ndarray, axis: int = -1, eps: float = L2_EPS) -> np.ndarray:
    """x / max(||x||_2, eps), as torch.nn.functional.normalize(p=2). Here, not in
    tensor_ops.py, because two step modules use it (l2_normalize and mean_pool)."""
    x = x.astype(np.float64 if x.dtype == np.float64 else np.float32, copy=False)
    norm = np.sqrt(np.sum(x * x, axis=axis, keepdims=True))
    return x / np.maximum(norm, x.dtype.type(eps))
