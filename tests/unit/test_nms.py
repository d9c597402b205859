"""Greedy NMS against a brute-force reference, edge cases, and the nms postprocess step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from inferd.errors import ModelConfigError
from inferd.steps.nms import nms
from inferd.steps.registry import build_steps


def iou(a: list[float], b: list[float]) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h

    def area(r: list[float]) -> float:
        return max(0.0, r[2] - r[0]) * max(0.0, r[3] - r[1])

    union = area(a) + area(b) - inter
    return inter / union if union > 0 else 0.0


def reference(
    boxes: np.ndarray,
    scores: np.ndarray,
    threshold: float,
    score_threshold: float,
    limit: int,
    classes: np.ndarray | None = None,
) -> list[int]:
    """The textbook loop: visit boxes best-first, keep one unless a kept box of its class
    overlaps it by more than the threshold."""
    order = sorted(
        (i for i in range(len(scores)) if scores[i] > score_threshold), key=lambda i: -scores[i]
    )
    kept: list[int] = []
    for i in order:
        if len(kept) == limit:
            break
        same = [k for k in kept if classes is None or classes[k] == classes[i]]
        if all(iou(boxes[i].tolist(), boxes[k].tolist()) <= threshold for k in same):
            kept.append(i)
    return kept


def random_boxes(rng: np.random.Generator, n: int) -> np.ndarray:
    xy = rng.uniform(0, 100, (n, 2))
    wh = rng.uniform(1, 40, (n, 2))
    return np.concatenate([xy, xy + wh], axis=1).astype(np.float32)


@pytest.mark.parametrize("seed", range(20))
def test_matches_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 80))
    boxes = random_boxes(rng, n)
    scores = rng.random(n).astype(np.float32)
    threshold = float(rng.uniform(0.1, 0.9))
    score_threshold = float(rng.uniform(0.0, 0.5))
    limit = int(rng.integers(1, 40))
    classes = rng.integers(0, 3, n) if seed % 2 else None
    got = nms(boxes, scores, threshold, score_threshold, limit, classes).tolist()
    assert got == reference(boxes, scores, threshold, score_threshold, limit, classes)


def test_edge_cases() -> None:
    box = [0.0, 0.0, 10.0, 10.0]
    empty = nms(np.zeros((0, 4)), np.zeros(0), 0.5)
    assert empty.dtype == np.int64 and empty.shape == (0,)
    # Identical boxes with equal scores: the lower index wins, the rest are suppressed.
    assert nms(np.array([box] * 3), np.array([0.5, 0.5, 0.5]), 0.5).tolist() == [0]
    # IoU exactly at the threshold is not suppressed (only IoU > threshold is).
    half = np.array([box, [0.0, 0.0, 10.0, 5.0]])  # IoU = 0.5
    assert nms(half, np.array([0.9, 0.8]), 0.5).tolist() == [0, 1]
    assert nms(half, np.array([0.9, 0.8]), 0.49).tolist() == [0]
    # Zero-area and inverted boxes overlap nothing; NaN scores and scores at the threshold drop.
    degenerate = np.array([box, [5, 5, 5, 5], [8, 8, 2, 2], box], dtype=np.float32)
    scores = np.array([0.9, 0.8, 0.7, np.nan], dtype=np.float32)
    assert nms(degenerate, scores, 0.1).tolist() == [0, 1, 2]
    assert nms(degenerate, scores, 0.1, score_threshold=0.8).tolist() == [0]
    # Different classes never suppress each other.
    assert nms(
        np.array([box, box]), np.array([0.9, 0.8]), 0.5, classes=np.array([0, 1])
    ).tolist() == [0, 1]


def test_step_pads_to_max_detections_and_derives_classes() -> None:
    (step,) = build_steps(
        [{"type": "nms", "iou_threshold": 0.5, "score_threshold": 0.1, "max_detections": 4}],
        stage="postprocess",
        model_dir=Path("."),
        version_dir=Path("."),
    )
    rng = np.random.default_rng(7)
    boxes = np.stack([random_boxes(rng, 30), random_boxes(rng, 30)])
    per_class = rng.random((2, 30, 3)).astype(np.float32)  # [n, N, C]
    out = step({"boxes": boxes, "scores": per_class, "other": np.ones(2)})
    assert set(out) == {
        "detection_boxes", "detection_scores", "detection_classes", "num_detections", "other"
    }  # fmt: skip
    assert out["detection_boxes"].shape == (2, 4, 4)
    assert out["detection_scores"].shape == out["detection_classes"].shape == (2, 4)
    scores, classes = per_class.max(axis=2), per_class.argmax(axis=2)
    for row in range(2):
        kept = reference(boxes[row], scores[row], 0.5, 0.1, 4, classes[row])
        count = int(out["num_detections"][row])
        assert count == len(kept)
        np.testing.assert_array_equal(out["detection_boxes"][row, :count], boxes[row, kept])
        np.testing.assert_array_equal(out["detection_classes"][row, :count], classes[row, kept])
        assert (out["detection_classes"][row, count:] == -1).all()


def test_step_shape_mismatch_is_a_config_error() -> None:
    (step,) = build_steps(
        [{"type": "nms"}], stage="postprocess", model_dir=Path("."), version_dir=Path(".")
    )
    with pytest.raises(ModelConfigError, match=r"postprocess\[0\]: expects boxes"):
        step({"boxes": np.zeros((1, 5, 2)), "scores": np.zeros((1, 5))})
