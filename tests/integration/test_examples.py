"""The built-in example repository: it builds (once, atomically, per BUILD_VERSION), every
config validates and builds its steps, and the models do what their labels say."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import yaml

from inferd.backends.base import BackendOptions
from inferd.batching.rules import QueueLimits
from inferd.examples import (
    FRAUD_FEATURES,
    SHAPES,
    draw_shape,
    ensure_example_repository,
    fraud_dataset,
)
from inferd.examples import repository as examples
from inferd.model_config import ModelRepoConfig
from inferd.repository.builder import build_model
from inferd.steps.classification import classify, load_labels
from inferd.steps.registry import build_steps


@pytest.fixture(scope="module")
def repo() -> Path:
    return ensure_example_repository()


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def load(repo: Path, name: str) -> ModelRepoConfig:
    return ModelRepoConfig.model_validate(
        yaml.safe_load((repo / name / "config.yaml").read_text(encoding="utf-8"))
    )


@pytest.mark.parametrize("name", ["minilm", "image", "fraud"])
def test_configs_validate_and_their_steps_build(repo: Path, name: str) -> None:
    config = load(repo, name)
    version = repo / name / "1"
    assert (version / (config.default_model_filename or "")).is_file()
    for stage in ("preprocess", "postprocess"):
        steps = build_steps(
            getattr(config, stage), stage=stage, model_dir=repo / name, version_dir=version
        )
        assert all(s.stage == stage for s in steps)
    for output in config.output:
        if output.label_filename:
            assert len(load_labels(version / output.label_filename)) == output.dims[0]
    declared = {i.name for i in session(version / "model.onnx").get_inputs()}
    expected = {"minilm": {"input_ids", "attention_mask"}, "image": {"input"}}
    assert declared == expected.get(name, {"features"})


@pytest.mark.parametrize("name", ["minilm", "image"])
def test_a_served_model_with_variable_lengths_learns_its_call_cost_at_start(
    repo: Path, name: str
) -> None:
    """The real ONNX model takes the synthetic zero batches (1 and 8 rows at lengths 16 and 64)
    and the fit finds a per-call and a per-token cost; the image model has no variable dim."""
    served = build_model(
        name,
        "1",
        load(repo, name),
        repo / name,
        repo / name / "1",
        BackendOptions(),
        QueueLimits(),
        observer=None,
    )

    async def started() -> float | None:
        await served.start()
        try:
            return served.call_overhead
        finally:
            await served.stop()

    overhead = asyncio.run(started())
    if name == "minilm":
        assert overhead is not None and overhead > 0.0
    else:
        assert overhead is None


def png(image: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")  # type: ignore[attr-defined]
    return buf.getvalue()


def test_image_model_recognises_new_pictures_of_each_shape(repo: Path) -> None:
    config = load(repo, "image")
    version = repo / "image" / "1"
    kw = {"model_dir": repo / "image", "version_dir": version}
    (pre,) = build_steps(config.preprocess, stage="preprocess", **kw)
    (post,) = build_steps(config.postprocess, stage="postprocess", **kw)
    model = session(version / "model.onnx")
    rng = np.random.default_rng(12345)  # pictures the model was not trained on
    per_shape = 25
    truth = np.repeat(np.arange(len(SHAPES)), per_shape)
    blobs = np.empty((len(truth), 1), dtype=object)
    for i, shape_index in enumerate(truth):
        blobs[i, 0] = png(draw_shape(SHAPES[shape_index], rng))
    tensors = pre({"image": blobs})
    (logits,) = model.run(["logits"], {"input": tensors["input"]})
    probs = post({"logits": logits})["probabilities"]
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-5)
    predicted = probs.argmax(axis=1)
    for k, shape in enumerate(SHAPES):
        accuracy = (predicted[truth == k] == k).mean()
        assert accuracy >= 0.8, f"{shape}: {accuracy:.0%}"
    top = classify(probs[:1], 1, load_labels(version / "labels.txt"))
    assert top[0, 0].decode().endswith(f":{predicted[0]}:{SHAPES[predicted[0]]}")


def test_fraud_model_probabilities(repo: Path) -> None:
    version = repo / "fraud" / "1"
    x, y = fraud_dataset(2000, seed=99)
    assert x.shape == (2000, len(FRAUD_FEATURES))
    label, probs = session(version / "model.onnx").run(["label", "probabilities"], {"features": x})
    assert label.shape == (2000, 1) and label.dtype == np.int64
    assert probs.shape == (2000, 2) and probs.dtype == np.float32
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(label[:, 0], probs.argmax(axis=1))
    # It learned the generator's pattern: ROC AUC on new rows (a fraud row outranks a legit one).
    fraud, legit = probs[y == 1, 1], probs[y == 0, 1]
    auc = (fraud[:, None] > legit[None, :]).mean() + 0.5 * (fraud[:, None] == legit[None, :]).mean()
    assert auc > 0.9


def test_build_is_cached_per_version_and_refuses_foreign_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds: list[Path] = []

    def fake_model(out: Path) -> None:  # stands in for the real (slow) builders
        out.mkdir()
        builds.append(out)

    monkeypatch.setattr(examples, "_BUILDERS", {"m": fake_model})
    root = tmp_path / "repo"
    assert ensure_example_repository(root) == root
    assert ensure_example_repository(root) == root
    assert len(builds) == 1 and (root / "m").is_dir()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == ["repo"]
    monkeypatch.setattr(examples, "BUILD_VERSION", examples.BUILD_VERSION + 1)
    ensure_example_repository(root)
    assert len(builds) == 2 and (root / ".build").read_text().strip() == str(examples.BUILD_VERSION)
    mine = tmp_path / "mine"
    (mine / "model").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="not an example repository"):
        ensure_example_repository(mine)
