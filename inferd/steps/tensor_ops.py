"""`softmax` and `l2_normalize`: elementwise-per-row postprocess steps.

    - {type: softmax, input: logits, output: probabilities, axis: -1}
    - {type: l2_normalize, input: embedding, output: embedding, axis: -1}

The step replaces `input` by `output` (the input is dropped unless it has the same name);
every other tensor passes through. Axes count from the request's batch dim, so the default
-1 is the class / feature axis whatever the rank.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from pydantic import Field

from inferd.errors import ModelConfigError
from inferd.steps.base import L2_EPS, StepContext, StepOptions, l2_normalize


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax in float32 (float64 input stays float64)."""
    x = x.astype(np.float64 if x.dtype == np.float64 else np.float32, copy=False)
    shifted = x - x.max(axis=axis, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=axis, keepdims=True)


class SoftmaxOptions(StepOptions):
    input: str = "logits"
    output: str = "probabilities"
    axis: int = -1


class L2NormalizeOptions(StepOptions):
    input: str = "embedding"
    output: str | None = None  # None: same as input
    axis: int = -1
    eps: float = Field(default=L2_EPS, gt=0.0)


class _AxisStep:
    """Take `input`, apply `fn` along `axis`, put `output`, pass the rest through."""

    def __init__(
        self,
        ctx: StepContext,
        name: str,
        output: str,
        axis: int,
        fn: Callable[[np.ndarray], np.ndarray],
    ) -> None:
        self.stage: str = ctx.stage
        self.ctx = ctx
        self.input = name
        self.output = output
        self.axis = axis
        self.fn = fn

    def __call__(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = self.ctx.take(tensors, self.input)
        if x.dtype.kind not in "fiu" or not -x.ndim <= self.axis < x.ndim:
            raise ModelConfigError(
                f"{self.ctx.where}: cannot apply on {self.input!r} ({x.dtype}, shape "
                f"{list(x.shape)}) along axis {self.axis}"
            )
        out = {k: v for k, v in tensors.items() if k != self.input}
        out[self.output] = self.fn(x)
        return out


class SoftmaxStep(_AxisStep):
    def __init__(self, options: SoftmaxOptions, ctx: StepContext) -> None:
        axis = options.axis
        super().__init__(ctx, options.input, options.output, axis, lambda x: softmax(x, axis))


class L2NormalizeStep(_AxisStep):
    def __init__(self, options: L2NormalizeOptions, ctx: StepContext) -> None:
        axis, eps = options.axis, options.eps
        output = options.output or options.input
        super().__init__(ctx, options.input, output, axis, lambda x: l2_normalize(x, axis, eps))
