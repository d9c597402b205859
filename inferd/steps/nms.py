"""`nms`: greedy non-maximum suppression of detector outputs, in numpy.

    - {type: nms, boxes: boxes, scores: scores, classes: null, iou_threshold: 0.5,
       score_threshold: 0.25, max_detections: 100}

boxes [n, N, 4] (x1, y1, x2, y2) and scores [n, N] -> per row, greedily: the best remaining box
is kept and every remaining box overlapping it with IoU > iou_threshold is dropped. Scores
[n, N, C] (one column per class) mean class = argmax and score = max. With classes (given or
so derived) only boxes of the same class suppress each other.

Outputs (names configurable through `outputs`), padded to max_detections, best first:
    detection_boxes FP32 [n, max_detections, 4]     detection_scores FP32 [n, max_detections]
    detection_classes INT64 [n, max_detections] (-1 pads; only when classes are known)
    num_detections INT64 [n]
Boxes with score <= score_threshold (or NaN) are never kept, as in ONNX NonMaxSuppression.
Equal scores keep the lower index first.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import Field, field_validator

from inferd.errors import ModelConfigError
from inferd.steps.base import StepContext, StepOptions

ROLES = {
    "boxes": "detection_boxes",
    "scores": "detection_scores",
    "classes": "detection_classes",
    "count": "num_detections",
}


def box_areas(boxes: np.ndarray) -> np.ndarray:
    """[N, 4] xyxy -> [N]; an inverted box has area 0."""
    return np.clip(boxes[:, 2] - boxes[:, 0], 0, None) * np.clip(boxes[:, 3] - boxes[:, 1], 0, None)


def iou_with(
    box: np.ndarray, area: float, others: np.ndarray, other_areas: np.ndarray
) -> np.ndarray:
    """IoU of one box [4] with others [M, 4] -> [M] (0 where the union is empty)."""
    w = np.clip(np.minimum(box[2], others[:, 2]) - np.maximum(box[0], others[:, 0]), 0, None)
    h = np.clip(np.minimum(box[3], others[:, 3]) - np.maximum(box[1], others[:, 1]), 0, None)
    inter = w * h
    union = area + other_areas - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


def nms(
    boxes: np.ndarray,
    scores: np.ndarray,
    iou_threshold: float,
    score_threshold: float = -np.inf,
    max_detections: int | None = None,
    classes: np.ndarray | None = None,
) -> np.ndarray:
    """Indices of the kept boxes [K] int64, best score first.

    One vectorised IoU pass per kept box: O(K * N), no N x N matrix (N may be thousands)."""
    boxes = boxes.astype(np.float64, copy=False)
    limit = len(scores) if max_detections is None else max_detections
    candidates = np.flatnonzero(scores > score_threshold)
    order = candidates[np.argsort(-scores[candidates], kind="stable")]
    areas = box_areas(boxes)
    keep: list[int] = []
    while order.size and len(keep) < limit:
        best, rest = order[0], order[1:]
        keep.append(int(best))
        suppress = iou_with(boxes[best], areas[best], boxes[rest], areas[rest]) > iou_threshold
        if classes is not None:
            suppress &= classes[rest] == classes[best]
        order = rest[~suppress]
    return np.asarray(keep, dtype=np.int64)


class NmsOptions(StepOptions):
    boxes: str = "boxes"
    scores: str = "scores"
    classes: str | None = None
    iou_threshold: float = Field(default=0.5, ge=0.0, le=1.0)
    score_threshold: float = 0.0
    max_detections: int = Field(default=100, gt=0)
    outputs: dict[str, str] = Field(default_factory=lambda: dict(ROLES))

    @field_validator("outputs", mode="before")
    @classmethod
    def _roles(cls, v: Any) -> Any:
        if isinstance(v, dict):
            unknown = sorted(set(v) - set(ROLES))
            if unknown:
                raise ValueError(f"unknown roles {unknown}; roles are {list(ROLES)}")
            v = {**ROLES, **v}
        return v


class NmsStep:
    def __init__(self, options: NmsOptions, ctx: StepContext) -> None:
        self.stage: str = ctx.stage
        self.ctx = ctx
        self.options = options

    def __call__(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        o = self.options
        boxes, scores, classes = self._inputs(tensors)
        n, k = boxes.shape[0], o.max_detections
        out_boxes = np.zeros((n, k, 4), dtype=np.float32)
        out_scores = np.zeros((n, k), dtype=np.float32)
        out_classes = np.full((n, k), -1, dtype=np.int64)
        counts = np.zeros(n, dtype=np.int64)
        for row in range(n):
            row_classes = None if classes is None else classes[row]
            kept = nms(boxes[row], scores[row], o.iou_threshold, o.score_threshold, k, row_classes)
            counts[row] = len(kept)
            out_boxes[row, : len(kept)] = boxes[row, kept]
            out_scores[row, : len(kept)] = scores[row, kept]
            if row_classes is not None:
                out_classes[row, : len(kept)] = row_classes[kept]
        consumed = {o.boxes, o.scores, o.classes}
        out = {name: v for name, v in tensors.items() if name not in consumed}
        out[o.outputs["boxes"]] = out_boxes
        out[o.outputs["scores"]] = out_scores
        out[o.outputs["count"]] = counts
        if classes is not None:
            out[o.outputs["classes"]] = out_classes
        return out

    def _inputs(
        self, tensors: dict[str, np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        o = self.options
        boxes = self.ctx.take(tensors, o.boxes)
        scores = self.ctx.take(tensors, o.scores)
        classes = None if o.classes is None else self.ctx.take(tensors, o.classes)
        if scores.ndim == 3 and classes is None:  # [n, N, C]: per-class scores
            classes, scores = scores.argmax(axis=2), scores.max(axis=2)
        ok = boxes.ndim == 3 and boxes.shape[2] == 4 and scores.shape == boxes.shape[:2]
        if not ok or (classes is not None and classes.shape != scores.shape):
            shapes = {"boxes": boxes.shape, "scores": scores.shape}
            if classes is not None:
                shapes["classes"] = classes.shape
            raise ModelConfigError(
                f"{self.ctx.where}: expects boxes [n, N, 4], scores [n, N] (or [n, N, C]) and "
                f"classes [n, N]; got { {k: list(v) for k, v in shapes.items()} }"
            )
        return boxes, scores, classes
