"""Where each checkpoint tensor goes inside the model's (often fused) parameters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class Convert:
    """Checkpoint tensors read together and turned into a target's rows: `fn` takes them in the
    order of `names` and returns the rows (gpt-oss's transposed or MXFP4-packed experts)."""

    names: tuple[str, ...]
    fn: Callable[[list[Tensor]], Tensor]


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: rows [row_start, row_start + rows) of `param_name`;
    with `convert`, the rows are what it makes of its tensors (each of its names maps to this
    same target), else the tensor as it is."""

    param_name: str
    row_start: int
    rows: int
    convert: Convert | None = None
