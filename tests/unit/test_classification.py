"""Triton's classification extension strings: "value:index[:label]", top-k per row."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from inferd.errors import InvalidRequestError, ModelConfigError
from inferd.steps.classification import classify, load_labels


def strings(array: np.ndarray) -> list[object]:
    return np.vectorize(lambda b: b.decode())(array).tolist()


def test_top_k_per_row_with_labels() -> None:
    scores = np.array([[0.1, 0.7, 0.2], [0.5, 0.25, 0.25]], dtype=np.float32)
    out = classify(scores, 2, ["cat", "dog", "fish"])
    assert out.shape == (2, 2) and out.dtype == object
    # Ties keep the lower index first.
    assert strings(out) == [
        ["0.700000:1:dog", "0.200000:2:fish"],
        ["0.500000:0:cat", "0.250000:1:dog"],
    ]


def test_without_labels_unbatched_and_k_past_the_classes() -> None:
    out = classify(np.array([0.25, -1.5, 3.0]), 5, None)
    assert out.shape == (3,)  # no batch dim; at most as many entries as classes
    assert strings(out) == ["3.000000:2", "0.250000:0", "-1.500000:1"]


def test_labels_only_for_indices_the_file_covers_and_integer_scores() -> None:
    out = classify(np.array([[1, 9, 4]], dtype=np.int32), 3, ["a", "b"])
    assert strings(out) == [["9:1:b", "4:2", "1:0:a"]]


def test_rows_with_several_dims_are_flattened_per_row() -> None:
    scores = np.arange(12, dtype=np.float32).reshape(2, 2, 3)
    assert strings(classify(scores, 1, None)) == [["5.000000:5"], ["11.000000:5"]]


def test_bad_requests() -> None:
    with pytest.raises(InvalidRequestError, match=">= 1"):
        classify(np.zeros((1, 3)), 0, None)
    with pytest.raises(InvalidRequestError, match="numeric"):
        classify(np.array([[b"x"]], dtype=object), 1, None)


def test_load_labels(tmp_path: Path) -> None:
    path = tmp_path / "labels.txt"
    path.write_text("legit\nfraud\n", encoding="utf-8")
    assert load_labels(path) == ["legit", "fraud"]
    with pytest.raises(ModelConfigError, match="cannot read labels"):
        load_labels(tmp_path / "missing.txt")
