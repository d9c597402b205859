"""The `image` example: a small CNN trained here for a few seconds on generated 64x64 pictures
of four shapes (labels.txt: circle, square, triangle, cross), exported to ONNX.
PNG/JPEG bytes -> probabilities FP32 [4]; the classification extension works on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from inferd.examples.common import SEED, name_dims, quiet, write_config, write_labels

SHAPES = ("circle", "square", "triangle", "cross")
IMAGE_SIZE = 32  # the CNN's input; pictures are drawn at 2x and resized by the image step


def draw_shape(shape: str, rng: np.random.Generator, size: int = 2 * IMAGE_SIZE) -> Any:
    """One PIL RGB picture of `shape` in a random colour, size and place on a random background."""
    from PIL import Image, ImageDraw

    background = tuple(int(c) for c in rng.integers(0, 256, 3))
    foreground = tuple(int((c + rng.integers(96, 160)) % 256) for c in background)
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    extent = float(rng.uniform(0.45, 0.85)) * size
    x0, y0 = (float(v) for v in rng.uniform(0, size - extent, 2))
    x1, y1 = x0 + extent, y0 + extent
    if shape == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=foreground)
    elif shape == "square":
        draw.rectangle((x0, y0, x1, y1), fill=foreground)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) / 2, y0), (x0, y1), (x1, y1)], fill=foreground)
    else:  # cross: two bars a third of the extent wide
        third = extent / 3
        draw.rectangle((x0 + third, y0, x1 - third, y1), fill=foreground)
        draw.rectangle((x0, y0 + third, x1, y1 - third), fill=foreground)
    noise = rng.normal(0.0, 6.0, (size, size, 3))
    pixels = np.clip(np.asarray(image, dtype=np.float32) + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def image_preprocess_spec() -> dict[str, Any]:
    return {
        "type": "image",
        "input": "image",
        "output": "input",
        "size": [IMAGE_SIZE, IMAGE_SIZE],
        "resample": "bilinear",
        "mean": [0.5, 0.5, 0.5],
        "std": [0.5, 0.5, 0.5],
        "layout": "NCHW",
    }


def _image_dataset(n_per_class: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Pictures through the same image step the server runs, so training sees what serving
    feeds the model: x [N, 3, 32, 32] float32, y [N] int64."""
    from inferd.steps.base import StepContext
    from inferd.steps.image import ImageOptions, ImageStep

    step = ImageStep(
        ImageOptions.model_validate(image_preprocess_spec()),
        StepContext("preprocess", "preprocess[0]", Path("."), Path(".")),
    )
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(len(SHAPES)), n_per_class)
    rng.shuffle(labels)
    pixels = np.stack([step.pixels(draw_shape(SHAPES[k], rng)) for k in labels])
    x = (pixels / np.float32(255.0) - np.float32(0.5)) / np.float32(0.5)
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2), dtype=np.float32), labels


def _shape_cnn() -> Any:
    from torch import nn

    # Flatten, not global pooling, at the end: where the corners and edges are is what tells
    # a triangle from a square, and keeping it makes a few seconds of training enough.
    return nn.Sequential(
        nn.Conv2d(3, 8, 5, stride=2, padding=2), nn.ReLU(),           # [8, 16, 16]
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # [16, 8, 8]
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # [32, 4, 4]
        nn.Flatten(), nn.Linear(32 * 4 * 4, len(SHAPES)),
    )  # fmt: skip


def train_shape_cnn(epochs: int = 6, n_per_class: int = 500) -> Any:
    import torch

    torch.manual_seed(SEED)
    x, y = _image_dataset(n_per_class, SEED)
    xs, ys = torch.from_numpy(x), torch.from_numpy(y)
    model = _shape_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(SEED)
    for _ in range(epochs):
        batches = torch.randperm(len(ys), generator=gen).split(64)  # type: ignore[no-untyped-call]
        for idx in batches:
            loss = torch.nn.functional.cross_entropy(model(xs[idx]), ys[idx])
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
    return model.eval()


def build_image(model_dir: Path) -> None:
    import torch

    version = model_dir / "1"
    version.mkdir(parents=True)
    model = train_shape_cnn()
    example = torch.zeros((2, 3, IMAGE_SIZE, IMAGE_SIZE))
    with quiet():
        program = torch.onnx.export(
            model,
            (example,),
            input_names=["input"],
            output_names=["logits"],
            dynamic_shapes=({0: torch.export.Dim("batch", max=4096)},),
            dynamo=True,
            verbose=False,
        )
    assert program is not None
    name_dims(program.model_proto, {0: "batch"})
    program.save(str(version / "model.onnx"))
    write_labels(version / "labels.txt", SHAPES)
    config = {
        "backend": "onnxruntime",
        "default_model_filename": "model.onnx",
        "max_batch_size": 32,
        "input": [{"name": "image", "data_type": "TYPE_STRING", "dims": [1]}],
        "output": [
            {
                "name": "probabilities",
                "data_type": "TYPE_FP32",
                "dims": [len(SHAPES)],
                "label_filename": "labels.txt",
            }
        ],
        "dynamic_batching": {"max_queue_delay_ms": 2},
        "parameters": {"intra_op_threads": 1},
        "preprocess": [image_preprocess_spec()],
        "postprocess": [{"type": "softmax", "input": "logits", "output": "probabilities"}],
    }
    write_config(
        model_dir,
        config,
        "A small CNN trained on generated pictures of four shapes (labels.txt).\n"
        "Send PNG/JPEG bytes; ask for `classification: 1` on probabilities for the label.",
    )
