"""Triton's classification extension: top-k "score:index[:label]" strings for an output.

    classify(np.array([[0.1, 0.7, 0.2]]), 2, ["cat", "dog", "fish"])
    -> array([[b'0.700000:1:dog', b'0.200000:2:fish']], dtype=object)

As Triton's server (src/classification.cc) writes them: classes sorted by value, highest
first; the value printed as C++ std::to_string does (floats with 6 decimals, integers as
integers); the label appended only when the label file has a line for that index; at most as
many entries as there are classes. Equal values keep the lower index first (Triton's order is
unspecified there).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from inferd.errors import InvalidRequestError, ModelConfigError


def classify(
    scores: np.ndarray,
    k: int,
    labels: Sequence[str] | None = None,
    *,
    batched: bool | None = None,
) -> np.ndarray:
    """BYTES [n, min(k, classes)] for scores [n, ...] (each row's elements are its classes), or
    [min(k, classes)] when the tensor has no batch dim (batched False; None: only a 1-D tensor
    is unbatched)."""
    if k < 1:
        raise InvalidRequestError(f"classification count must be >= 1, got {k}", "classification")
    if scores.dtype.kind not in "fiu":
        raise InvalidRequestError(
            f"classification needs a numeric output, not {scores.dtype}", "classification"
        )
    if batched is None:
        batched = scores.ndim > 1
    rows = scores.reshape(scores.shape[0], -1) if batched else scores.reshape(1, -1)
    count = min(k, rows.shape[1])
    # Stable sort of the negated values: highest first, ties in index order.
    order = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, :count]
    out = np.empty((rows.shape[0], count), dtype=object)
    as_int = rows.dtype.kind in "iu"
    for r in range(rows.shape[0]):
        for c, index in enumerate(order[r]):
            value = rows[r, index]
            text = f"{int(value)}:{index}" if as_int else f"{float(value):f}:{index}"
            if labels is not None and index < len(labels):
                text += f":{labels[index]}"
            out[r, c] = text.encode("utf-8")
    return out if batched else out[0]


def load_labels(path: Path) -> list[str]:
    """One label per line (line i: class i), as Triton's label_filename."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"cannot read labels {path}: {e}") from e
    return text.splitlines()
