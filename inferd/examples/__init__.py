"""The built-in example model repository (minilm, image, fraud): real models built locally
with no download, for `inferd serve --model-repository examples`, the docs and the tests.

Not part of the serving lane: nothing under inferd/ imports this package at module level (the
server imports it lazily when asked for `examples`). repository.py builds the folder; one
module per example model; common.py holds what the builders share.
"""

from inferd.examples.fraud import FRAUD_FEATURES, FRAUD_LABELS, fraud_dataset
from inferd.examples.image import IMAGE_SIZE, SHAPES, draw_shape, image_preprocess_spec
from inferd.examples.repository import (
    BUILD_VERSION,
    build_example_repository,
    ensure_example_repository,
)

__all__ = [
    "BUILD_VERSION",
    "FRAUD_FEATURES",
    "FRAUD_LABELS",
    "IMAGE_SIZE",
    "SHAPES",
    "build_example_repository",
    "draw_shape",
    "ensure_example_repository",
    "fraud_dataset",
    "image_preprocess_spec",
]
