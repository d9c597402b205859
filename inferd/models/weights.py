"""Where each checkpoint tensor goes inside the model's (often fused) parameters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: rows [row_start, row_start + rows) of `param_name`."""

    param_name: str
    row_start: int
    rows: int
