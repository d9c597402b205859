"""The model repository over real tiny models: scan, load, versions, reload/unload under load,
failures that stay with their model, metadata/config JSON."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from google.protobuf import json_format
from test_backends import (
    LINEAR_TENSORS,
    PYTHON_TENSORS,
    reference,
    write_linear_onnx,
    write_pt2,
    write_python_model,
    write_torchscript,
)

from inferd.backends import BackendOptions
from inferd.errors import (
    ModelConfigError,
    ModelLoadError,
    ModelNotFoundError,
    ModelNotReadyError,
)
from inferd.gateway.kserve.proto import model_config_pb2
from inferd.repository.manager import ModelRepository
from inferd.tensors import InferRequest, RequestedOutput

X = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
Writer = Callable[[Path], None]


def add_model(root: Path, name: str, config: dict[str, Any], versions: dict[int, Writer]) -> Path:
    model_dir = root / name
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.yaml").write_text(yaml.safe_dump(config))
    for number, write in versions.items():
        write(model_dir / str(number))
    return model_dir


def onnx_version(scale: float = 1.0) -> Writer:
    return lambda d: write_linear_onnx(d / "model.onnx", scale)


def request(model: str, x: np.ndarray = X, **fields: Any) -> InferRequest:
    return InferRequest(model_name=model, inputs={"x": x}, **fields)


def outputs(response: Any) -> dict[str, np.ndarray]:
    return {o.name: o.data for o in response.outputs}


LINEAR_ONNX = {"backend": "onnxruntime", "max_batch_size": 8}

EMBEDDER = """
import numpy as np

class Model:
    def predict(self, inputs):
        lengths = [float(len(t)) for t in inputs["text"].reshape(-1)]
        return {"embedding": np.array([[n, 1.0] for n in lengths], dtype=np.float32)}
"""


# -- every backend through the repository -----------------------------------------------------


async def _serve_every_backend(root: Path) -> None:
    repo = ModelRepository(root)
    await repo.start()
    assert repo.ready()
    assert [e["state"] for e in repo.index()] == ["READY"] * 5
    assert repo.model_names() == ["embedder", "exported", "linear", "pyfunc", "scripted"]
    assert repo.embedding_models() == ["embedder"]
    expected = reference(X)
    for name in ("linear", "scripted", "exported"):
        got = outputs(await repo.get(name).infer(request(name)))
        np.testing.assert_allclose(got["probs"], expected["probs"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["logits"], expected["logits"], rtol=1e-5, atol=1e-5)
    x = np.ones((2, 2), np.float32)
    got = outputs(await repo.get("pyfunc").infer(request("pyfunc", x)))
    np.testing.assert_array_equal(got["y"], (x + 1) * 3 - 1)  # preprocess, predict, postprocess
    text = np.array([[b"abc"], [b"hello"]], dtype=object)
    embedded = await repo.get("embedder").infer(InferRequest("embedder", {"text": text}))
    np.testing.assert_array_equal(outputs(embedded)["embedding"], [[3, 1], [5, 1]])
    await repo.shutdown()
    assert not repo.model_names()


def test_repository_serves_every_backend(tmp_path: Path) -> None:
    # linear lists no tensors: they come from the ONNX file (auto-complete).
    add_model(tmp_path, "linear", LINEAR_ONNX, {1: onnx_version()})
    add_model(
        tmp_path,
        "scripted",
        {"backend": "pytorch", **LINEAR_TENSORS},
        {1: lambda d: write_torchscript(d / "model.pt")},
    )
    add_model(
        tmp_path,
        "exported",
        {"platform": "pytorch_libtorch", **LINEAR_TENSORS, "instance_group": [{"count": 2}]},
        {1: lambda d: write_pt2(d / "model.pt2")},
    )
    add_model(
        tmp_path,
        "pyfunc",
        {"backend": "python", "parameters": {"factor": 3}, **PYTHON_TENSORS},
        {1: write_python_model},
    )
    add_model(
        tmp_path,
        "embedder",
        {
            "backend": "python",
            "max_batch_size": 4,
            "input": [{"name": "text", "data_type": "BYTES", "dims": [1]}],
            "output": [{"name": "embedding", "data_type": "FP32", "dims": [2]}],
            "embedding": {"input": "text", "output": "embedding"},
        },
        {1: lambda d: write_python_model(d, EMBEDDER)},
    )
    asyncio.run(_serve_every_backend(tmp_path))


# -- failures stay with their model -----------------------------------------------------------


def _bad_models(root: Path) -> dict[str, str]:
    """Broken models next to a good one; name -> a part of the reason index() must give."""
    good = {1: onnx_version()}
    add_model(root, "good", LINEAR_ONNX, good)
    add_model(root, "unknown_key", {**LINEAR_ONNX, "max_batch": 4}, good)
    bad_type = {**LINEAR_ONNX, "input": [{"name": "x", "data_type": "TYPE_FP99", "dims": [4]}]}
    add_model(root, "bad_type", bad_type, good)
    add_model(root, "bad_policy", {**LINEAR_ONNX, "version_policy": {"newest": {}}}, good)
    add_model(root, "name_mismatch", {**LINEAR_ONNX, "name": "other"}, good)
    add_model(root, "no_file", LINEAR_ONNX, {1: lambda d: d.mkdir()})
    add_model(root, "broken_onnx", LINEAR_ONNX, {1: _write_garbage})
    add_model(root, "no_versions", LINEAR_ONNX, {})
    wrong_name = {**LINEAR_ONNX, "input": [{"name": "features", "data_type": "FP32", "dims": [4]}]}
    add_model(root, "wrong_input", wrong_name, good)
    add_model(root, "unbatched_file", {**LINEAR_ONNX, "max_batch_size": 0}, good)
    add_model(root, "fixed_batch", LINEAR_ONNX, {1: _write_fixed_batch_onnx})
    return {
        "unknown_key": "unknown_key/config.yaml: max_batch: Extra inputs are not permitted",
        "bad_type": "bad_type/config.yaml: input[0].data_type: unknown data",
        "bad_policy": "bad_policy/config.yaml: version_policy.newest: Extra inputs",
        "name_mismatch": "name: 'other' must equal the folder name 'name_mismatch'",
        "no_file": "model.onnx not found",
        "broken_onnx": "model.onnx: onnxruntime cannot load it",
        "no_versions": "no version folder matches version_policy",
        "wrong_input": "wrong_input/config.yaml: input[0].name: 'features' is not an input",
        "unbatched_file": "",  # max_batch_size 0 takes the file's shapes as they are: it loads
        "fixed_batch": "max_batch_size: 8 but the model's input 'x' has no variable batch",
    }


def _write_garbage(version_dir: Path) -> None:
    version_dir.mkdir(parents=True)
    (version_dir / "model.onnx").write_bytes(b"\x08\x01garbage")


def _write_fixed_batch_onnx(version_dir: Path) -> None:
    import onnx

    write_linear_onnx(version_dir / "model.onnx")
    model = onnx.load(str(version_dir / "model.onnx"))
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2
    onnx.save(model, str(version_dir / "model.onnx"))


async def _failures_stay_local(root: Path, expected: dict[str, str]) -> None:
    repo = ModelRepository(root)
    await repo.start()  # never raises for a bad model
    index = {e["name"]: e for e in repo.index()}
    assert index["good"]["state"] == "READY"
    for name, reason in expected.items():
        if not reason:
            assert index[name]["state"] == "READY"
            continue
        assert index[name]["state"] == "UNAVAILABLE", name
        assert reason in index[name]["reason"], (name, index[name]["reason"])
        with pytest.raises(ModelNotReadyError, match="not ready"):
            repo.get(name)
    np.testing.assert_allclose(
        outputs(await repo.get("good").infer(request("good")))["logits"],
        reference(X)["logits"],
        rtol=1e-5,
    )
    assert not repo.ready()  # strict readiness: models that failed to load count
    with pytest.raises(ModelConfigError, match="max_batch: Extra inputs"):
        await repo.load("unknown_key")
    for name, reason in expected.items():
        if reason:
            await repo.unload(name)
    assert repo.ready()
    assert {e["reason"] for e in repo.index() if e["state"] == "UNAVAILABLE"} == {"unloaded"}
    await repo.shutdown()


def test_bad_models_fail_alone(tmp_path: Path) -> None:
    expected = _bad_models(tmp_path)
    asyncio.run(_failures_stay_local(tmp_path, expected))


async def _lookup_errors(root: Path) -> None:
    repo = ModelRepository(root)
    await repo.start(["good", "ghost"])
    assert not repo.ready()  # ghost was asked for and does not exist
    ghost = next(e for e in repo.index() if e["name"] == "ghost")
    assert ghost["state"] == "UNAVAILABLE"
    assert next(e for e in repo.index() if e["name"] == "idle") == {
        "name": "idle",
        "version": "",
        "state": "",
        "reason": "",
    }
    for name in ("nope", "../good", ".", ""):
        with pytest.raises(ModelNotFoundError):
            repo.get(name)
    with pytest.raises(ModelNotReadyError, match="not loaded"):
        repo.get("idle")
    with pytest.raises(ModelNotFoundError, match="no ready version '2'"):
        repo.get("good", "2")
    assert repo.get("good", "0001").version == "1"
    with pytest.raises(ModelNotFoundError):
        repo.versions("nope")
    with pytest.raises(ModelNotFoundError):
        await repo.load("nope")
    with pytest.raises(ModelNotFoundError):
        await repo.unload("nope")
    assert repo.versions("idle") == []
    await repo.shutdown()


def test_lookup_errors(tmp_path: Path) -> None:
    add_model(tmp_path, "good", LINEAR_ONNX, {1: onnx_version()})
    add_model(tmp_path, "idle", LINEAR_ONNX, {1: onnx_version()})
    with pytest.raises(ModelConfigError, match="is not a folder"):
        ModelRepository(tmp_path / "missing")
    asyncio.run(_lookup_errors(tmp_path))


# -- versions ---------------------------------------------------------------------------------


async def _policies(root: Path, model_dir: Path) -> None:
    repo = ModelRepository(root)
    await repo.start()

    async def logits_scale(version: str = "") -> float:
        served = repo.get("versioned", version)
        got = outputs(await served.infer(request("versioned")))["logits"]
        return float(np.round(got[0, 0] / reference(X)["logits"][0, 0], 3))

    assert repo.versions("versioned") == ["3"]
    assert await logits_scale() == 3.0
    cases: list[tuple[dict[str, Any], list[str]]] = [
        ({"latest": {"num_versions": 2}}, ["2", "3"]),
        ({"all": {}}, ["1", "2", "3"]),
        ({"specific": {"versions": [1, 3]}}, ["1", "3"]),
    ]
    for policy, versions in cases:
        (model_dir / "config.yaml").write_text(
            yaml.safe_dump({**LINEAR_ONNX, "version_policy": policy})
        )
        await repo.load("versioned")
        assert repo.versions("versioned") == versions
        assert [e["version"] for e in repo.index()] == versions
        for version in versions:
            assert await logits_scale(version) == float(version)
        assert await logits_scale() == 3.0  # "" is the highest ready version
    with pytest.raises(ModelNotFoundError):
        repo.get("versioned", "2")
    meta = repo.metadata("versioned", "1")
    assert meta["versions"] == ["1", "3"]
    await repo.shutdown()


def test_version_policies(tmp_path: Path) -> None:
    model_dir = add_model(
        tmp_path, "versioned", LINEAR_ONNX, {n: onnx_version(float(n)) for n in (1, 2, 3)}
    )
    (model_dir / "notes").mkdir()  # not a number: ignored
    asyncio.run(_policies(tmp_path, model_dir))


# -- reload / unload while requests are in flight ---------------------------------------------

# The model answers only once the gate file exists: the test decides when requests in flight
# finish, instead of a sleep in the model guessing how long the test needs them in flight.
GATED_MODEL = """
import os
import time
import numpy as np

GATE = {gate!r}

class Model:
    def initialize(self, config, version_dir):
        self.version = float(version_dir.name)

    def predict(self, inputs):
        while not os.path.exists(GATE):
            time.sleep(0.005)
        return {{"y": inputs["x"] * 0 + self.version}}
"""
GATED_CONFIG = {
    "backend": "python",
    "max_batch_size": 8,
    "input": [{"name": "x", "data_type": "FP32", "dims": [1]}],
    "output": [{"name": "y", "data_type": "FP32", "dims": [1]}],
    "dynamic_batching": {"max_queue_delay_ms": 20},
}


async def until(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "the condition never held"
        await asyncio.sleep(0.005)


async def _in_flight(root: Path, model_dir: Path, gate: Path) -> None:
    repo = ModelRepository(root)
    await repo.start()
    one = np.ones((1, 1), np.float32)

    async def call() -> float:
        response = await repo.get("slow").infer(request("slow", one))
        return float(outputs(response)["y"][0, 0])

    # Reload onto version 2 while six requests are held in version 1.
    v1 = repo.get("slow")
    first = [asyncio.create_task(call()) for _ in range(6)]
    await until(lambda: v1.inflight == 6)
    write_python_model(model_dir / "2", GATED_MODEL.format(gate=str(gate)))
    loading = asyncio.create_task(repo.load("slow"))
    await until(lambda: repo.versions("slow") == ["2"])  # swapped in; v1 still holds six
    assert v1.inflight == 6
    gate.touch()
    await loading
    assert await asyncio.gather(*first) == [1.0] * 6  # in-flight requests finished on v1
    assert await call() == 2.0

    # Unload while requests are in flight: they finish, later ones are refused.
    gate.unlink()
    v2 = repo.get("slow")
    second = [asyncio.create_task(call()) for _ in range(4)]
    await until(lambda: v2.inflight == 4)
    unloading = asyncio.create_task(repo.unload("slow"))
    await until(lambda: {e["state"] for e in repo.index()} == {"UNLOADING"})
    with pytest.raises(ModelNotReadyError):
        repo.get("slow")
    assert not unloading.done()
    gate.touch()
    await unloading
    assert await asyncio.gather(*second) == [2.0] * 4
    assert repo.index()[0]["state"] == "UNAVAILABLE"
    await repo.shutdown()


def test_reload_and_unload_with_requests_in_flight(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    model = GATED_MODEL.format(gate=str(gate))
    root = tmp_path / "repo"
    model_dir = add_model(root, "slow", GATED_CONFIG, {1: lambda d: write_python_model(d, model)})
    asyncio.run(_in_flight(root, model_dir, gate))


async def _failed_reload(root: Path, model_dir: Path) -> None:
    repo = ModelRepository(root)
    await repo.start()
    good_config = (model_dir / "config.yaml").read_text()
    (model_dir / "config.yaml").write_text(good_config + "instance_count: 0\n")
    with pytest.raises(ModelConfigError, match="instance_count: Input should be greater"):
        await repo.load("linear")
    entry = repo.index()[0]
    assert entry["state"] == "READY"  # the old version still serves
    assert "reload failed" in entry["reason"]
    assert repo.ready()
    await repo.get("linear").infer(request("linear"))
    # A version that fails to open fails the whole reload, and the old set stays.
    _write_garbage(model_dir / "2")
    (model_dir / "config.yaml").write_text(good_config)
    with pytest.raises(ModelLoadError, match="onnxruntime cannot load it"):
        await repo.load("linear")
    assert repo.versions("linear") == ["1"]
    (model_dir / "2" / "model.onnx").unlink()
    onnx_version(2.0)(model_dir / "2")
    await repo.load("linear")
    assert repo.versions("linear") == ["2"]
    assert repo.index()[0]["reason"] == ""
    await repo.shutdown()


def test_failed_reload_keeps_old_versions(tmp_path: Path) -> None:
    model_dir = add_model(tmp_path, "linear", LINEAR_ONNX, {1: onnx_version()})
    asyncio.run(_failed_reload(tmp_path, model_dir))


# -- metadata, config JSON, labels, pickle ----------------------------------------------------


async def _described(root: Path) -> None:
    repo = ModelRepository(root)
    await repo.start()
    assert repo.metadata("fraud") == {
        "name": "fraud",
        "versions": ["1"],
        "platform": "onnxruntime_onnx",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [
            {"name": "probs", "datatype": "FP32", "shape": [-1, 3]},
            {"name": "logits", "datatype": "FP32", "shape": [-1, 3]},
        ],
    }
    config = repo.config_dict("fraud")
    assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}]
    assert config["output"][0]["label_filename"] == "labels.txt"
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 1500
    assert config["instance_group"] == [{"count": 2, "kind": "KIND_CPU"}]
    assert config["version_policy"] == {"latest": {"num_versions": 1}}
    assert config["parameters"] == {"intra_op_threads": {"string_value": "1"}}
    # Every key is a field of Triton's ModelConfig message (strict parse, no unknown fields).
    parsed = json_format.ParseDict(config, model_config_pb2.ModelConfig())
    assert parsed.max_batch_size == 8
    # Labels reach the classification extension.
    asked = [RequestedOutput("probs", classification=2)]
    response = await repo.get("fraud").infer(request("fraud", outputs=asked))
    top = outputs(response)["probs"]
    probs = reference(X)["probs"]
    best = int(np.argmax(probs[0]))
    assert top.shape == (3, 2)
    assert top[0, 0] == f"{probs[0, best]:f}:{best}:class-{best}".encode()
    await repo.shutdown()


def test_metadata_config_and_labels(tmp_path: Path) -> None:
    model_dir = add_model(
        tmp_path,
        "fraud",
        {
            **LINEAR_ONNX,
            "instance_count": 2,
            "parameters": {"intra_op_threads": 1},
            "dynamic_batching": {"max_queue_delay_ms": 1.5, "preferred_batch_sizes": [4]},
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
            "output": [
                {"name": "probs", "data_type": "FP32", "dims": [3], "label_filename": "labels.txt"},
                {"name": "logits", "data_type": "FP32", "dims": [3]},
            ],
        },
        {1: onnx_version()},
    )
    (model_dir / "labels.txt").write_text("class-0\nclass-1\nclass-2\n")  # model folder: fallback
    asyncio.run(_described(tmp_path))


async def _pickle_policy(root: Path) -> None:
    refused = ModelRepository(root)
    await refused.start()
    assert "--allow-pickle" in refused.index()[0]["reason"]
    await refused.shutdown()
    allowed = ModelRepository(root, options=BackendOptions(allow_pickle=True))
    await allowed.start()
    got = outputs(await allowed.get("pickled").infer(request("pickled")))
    np.testing.assert_allclose(got["logits"], reference(X)["logits"], rtol=1e-5, atol=1e-6)
    await allowed.shutdown()


def test_pickled_model_needs_allow_pickle(tmp_path: Path) -> None:
    from test_backends import LinearNet

    def write(version_dir: Path) -> None:
        version_dir.mkdir(parents=True)
        torch.save(LinearNet(), version_dir / "model.pt")

    add_model(tmp_path, "pickled", {"backend": "pytorch", **LINEAR_TENSORS}, {1: write})
    asyncio.run(_pickle_policy(tmp_path))


async def _steps(root: Path) -> None:
    repo = ModelRepository(root)
    await repo.start(["stepped", "bad_step"])
    config = repo.config_dict("stepped")
    # Inputs come from the file; outputs stay open: the softmax step makes what the client gets.
    assert [t["name"] for t in config["input"]] == ["x"]
    assert config["output"] == []
    got = outputs(await repo.get("stepped").infer(request("stepped")))
    np.testing.assert_allclose(got["probabilities"], reference(X, 2.0)["probs"], rtol=1e-5)
    reason = next(e["reason"] for e in repo.index() if e["name"] == "bad_step")
    assert "bad_step/config.yaml: postprocess[0].inputt: Extra inputs" in reason
    await repo.shutdown()


def test_config_steps_are_built(tmp_path: Path) -> None:
    softmax = {"type": "softmax", "input": "logits", "output": "probabilities"}
    add_model(tmp_path, "stepped", {**LINEAR_ONNX, "postprocess": [softmax]}, {1: onnx_version(2)})
    bad = {**LINEAR_ONNX, "postprocess": [{"type": "softmax", "inputt": "logits"}]}
    add_model(tmp_path, "bad_step", bad, {1: onnx_version()})
    asyncio.run(_steps(tmp_path))
