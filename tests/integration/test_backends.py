"""Backends on real tiny models written in the test: ONNX Runtime, TorchScript, torch.export,
Python; the reference is numpy / the torch module itself. Also the pickle policy.

The model writers here are shared with test_repository.py.
"""

from __future__ import annotations

import json
import pickle
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from inferd.backends import BackendOptions, open_backend
from inferd.backends.base import TensorSpec
from inferd.backends.torch import pt2_pickle_reason
from inferd.errors import InvalidRequestError, ModelConfigError, ModelLoadError
from inferd.model_config import ModelRepoConfig

RNG = np.random.default_rng(0)
W = RNG.standard_normal((4, 3)).astype(np.float32)
B = RNG.standard_normal(3).astype(np.float32)

LINEAR_TENSORS: dict[str, Any] = {
    "max_batch_size": 8,
    "input": [{"name": "x", "data_type": "FP32", "dims": [4]}],
    "output": [
        {"name": "probs", "data_type": "FP32", "dims": [3]},
        {"name": "logits", "data_type": "FP32", "dims": [3]},
    ],
}


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def reference(x: np.ndarray, scale: float = 1.0) -> dict[str, np.ndarray]:
    logits = (x @ W + B) * scale
    return {"probs": softmax(logits), "logits": logits}


def write_linear_onnx(path: Path, scale: float = 1.0) -> None:
    """probs = softmax(logits), logits = (x @ W + B) * scale; x: [batch, 4] FP32."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"]),
        helper.make_node("Add", ["xw", "B"], ["raw"]),
        helper.make_node("Mul", ["raw", "scale"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
    ]
    inits = [
        numpy_helper.from_array(W, "W"),
        numpy_helper.from_array(B, "B"),
        numpy_helper.from_array(np.array(scale, np.float32), "scale"),
    ]
    graph = helper.make_graph(
        nodes,
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [
            helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3]),
        ],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def write_string_onnx(path: Path) -> None:
    """echo = text (STRING [batch, 1]) and ids = INT64 passthrough: BYTES in and out."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["text"], ["echo"])],
        "strings",
        [helper.make_tensor_value_info("text", TensorProto.STRING, ["n", 1])],
        [helper.make_tensor_value_info("echo", TensorProto.STRING, ["n", 1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


class LinearNet(torch.nn.Module):
    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        with torch.no_grad():
            self.linear.weight.copy_(torch.from_numpy(W.T.copy()))
            self.linear.bias.copy_(torch.from_numpy(B))
        self.scale = scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.linear(x) * self.scale
        return torch.softmax(logits, dim=-1), logits


def write_torchscript(path: Path, scale: float = 1.0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    traced = torch.jit.trace(LinearNet(scale).eval(), torch.zeros(2, 4))  # type: ignore[no-untyped-call]
    traced.save(str(path))


def write_pt2(path: Path, scale: float = 1.0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(
        LinearNet(scale).eval(), (torch.zeros(2, 4),), dynamic_shapes=({0: batch},)
    )
    torch.export.save(program, str(path))


PYTHON_MODEL = """
import numpy as np

LOADS = []  # module global: each instance imports its own copy


class Model:
    def initialize(self, config, version_dir):
        LOADS.append(config["name"])
        self.factor = float(config["parameters"].get("factor", 2))
        self.version = version_dir.name

    def preprocess(self, inputs):
        return {**inputs, "x": inputs["x"] + 1}

    def predict(self, inputs):
        x = inputs["x"]
        labels = [f"v{self.version}:{len(LOADS)}" for _ in range(len(x))]
        return {"y": x * self.factor, "label": np.array(labels).reshape(-1, 1)}

    def postprocess(self, outputs):
        return {**outputs, "y": outputs["y"] - 1}
"""

PYTHON_TENSORS: dict[str, Any] = {
    "max_batch_size": 4,
    "input": [{"name": "x", "data_type": "FP32", "dims": [2]}],
    "output": [
        {"name": "y", "data_type": "FP32", "dims": [2]},
        {"name": "label", "data_type": "BYTES", "dims": [1]},
    ],
}


def write_python_model(version_dir: Path, source: str = PYTHON_MODEL) -> None:
    version_dir.mkdir(parents=True, exist_ok=True)
    (version_dir / "model.py").write_text(textwrap.dedent(source))


def config(backend: str, **fields: Any) -> ModelRepoConfig:
    return ModelRepoConfig.model_validate({"name": "m", "backend": backend, **fields})


X = RNG.standard_normal((5, 4)).astype(np.float32)


# -- ONNX Runtime ---------------------------------------------------------------------------


def test_onnx_matches_numpy_and_reports_its_tensors(tmp_path: Path) -> None:
    write_linear_onnx(tmp_path / "model.onnx", scale=0.5)
    backend = open_backend(config("onnxruntime"), tmp_path, BackendOptions())
    assert backend.platform == "onnxruntime_onnx"
    assert backend.inputs() == [TensorSpec("x", "FP32", (-1, 4))]
    assert backend.outputs() == [
        TensorSpec("probs", "FP32", (-1, 3)),
        TensorSpec("logits", "FP32", (-1, 3)),
    ]
    out = backend.infer({"x": X, "ignored": np.zeros(1)})
    expected = reference(X, 0.5)
    np.testing.assert_allclose(out["probs"], expected["probs"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["logits"], expected["logits"], rtol=1e-5, atol=1e-6)
    backend.close()


def test_onnx_bytes_travel_as_bytes(tmp_path: Path) -> None:
    write_string_onnx(tmp_path / "model.onnx")
    backend = open_backend(config("onnxruntime"), tmp_path, BackendOptions())
    assert backend.inputs() == [TensorSpec("text", "BYTES", (-1, 1))]
    text = np.array([[b"hello"], ["h\u00e9".encode()]], dtype=object)
    echo = backend.infer({"text": text})["echo"]
    assert echo.dtype == object
    assert echo.tolist() == [[b"hello"], ["h\u00e9".encode()]]
    with pytest.raises(InvalidRequestError, match="not UTF-8"):
        backend.infer({"text": np.array([[b"\xff"]], dtype=object)})


def test_onnx_rejected_shape_is_a_request_error(tmp_path: Path) -> None:
    write_linear_onnx(tmp_path / "model.onnx")
    backend = open_backend(config("onnxruntime"), tmp_path, BackendOptions())
    with pytest.raises(InvalidRequestError):
        backend.infer({"x": np.zeros((2, 5), np.float32)})


def test_onnx_threads_config_over_server_option(tmp_path: Path) -> None:
    write_linear_onnx(tmp_path / "model.onnx")
    options = BackendOptions(intra_op_threads=2, inter_op_threads=1)
    configured = config("onnxruntime", parameters={"intra_op_threads": 1})
    backend: Any = open_backend(configured, tmp_path, options)
    session_options = backend._session.get_session_options()
    assert session_options.intra_op_num_threads == 1  # config.yaml wins
    assert session_options.inter_op_num_threads == 1  # server option fills the gap


def _spinning(session: Any) -> tuple[str, str]:
    options = session.get_session_options()

    def entry(key: str) -> str:
        try:
            return str(options.get_session_config_entry(key))
        except RuntimeError:  # not set
            return ""

    return entry("session.intra_op.allow_spinning"), entry("session.force_spinning_stop")


def test_onnx_spinning_auto_gives_a_lone_request_a_spinning_twin(tmp_path: Path) -> None:
    write_linear_onnx(tmp_path / "model.onnx")
    backend: Any = open_backend(config("onnxruntime"), tmp_path, BackendOptions())
    assert backend._alone is not backend._session
    assert _spinning(backend._session)[0] == "0"  # batches: threads sleep between ops
    assert _spinning(backend._alone) == ("1", "1")  # alone: spin within the run, stop at its end
    np.testing.assert_allclose(
        backend.infer_alone({"x": X})["probs"], reference(X)["probs"], rtol=1e-5, atol=1e-6
    )
    np.testing.assert_array_equal(
        backend.infer_alone({"x": X})["probs"], backend.infer({"x": X})["probs"]
    )
    backend.close()
    with pytest.raises(RuntimeError, match="closed"):
        backend.infer_alone({"x": X})


@pytest.mark.parametrize(
    ("value", "spinning"), [("run", ("1", "1")), (0, ("0", "")), ("1", ("1", ""))]
)
def test_onnx_spinning_set_by_hand_is_one_session(
    tmp_path: Path, value: object, spinning: tuple[str, str]
) -> None:
    write_linear_onnx(tmp_path / "model.onnx")
    configured = config("onnxruntime", parameters={"allow_spinning": value})
    backend: Any = open_backend(configured, tmp_path, BackendOptions())
    assert backend._alone is backend._session and _spinning(backend._session) == spinning
    bad = config("onnxruntime", parameters={"allow_spinning": "sometimes"})
    with pytest.raises(ModelLoadError, match="allow_spinning"):
        open_backend(bad, tmp_path, BackendOptions())


def test_onnx_cuda_without_provider_fails_the_load(tmp_path: Path) -> None:
    write_linear_onnx(tmp_path / "model.onnx")
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has CUDA")
    with pytest.raises(ModelLoadError, match=r"parameters\.device: cuda"):
        open_backend(
            config("onnxruntime", parameters={"device": "cuda"}), tmp_path, BackendOptions()
        )


def test_broken_onnx_and_missing_file_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"model\.onnx not found"):
        open_backend(config("onnxruntime"), tmp_path, BackendOptions())
    (tmp_path / "model.onnx").write_bytes(b"not a protobuf at all")
    with pytest.raises(ModelLoadError, match=r"model\.onnx: onnxruntime cannot load it"):
        open_backend(config("onnxruntime"), tmp_path, BackendOptions())
    named = config("onnxruntime", default_model_filename="other.onnx")
    with pytest.raises(ModelLoadError, match=r"other\.onnx not found \(default_model_filename\)"):
        open_backend(named, tmp_path, BackendOptions())


# -- PyTorch ----------------------------------------------------------------------------------


@pytest.mark.parametrize("filename", ["model.pt", "model.pt2"])
def test_torch_matches_the_module(tmp_path: Path, filename: str) -> None:
    writer = write_torchscript if filename == "model.pt" else write_pt2
    writer(tmp_path / filename, scale=2.0)
    backend = open_backend(config("pytorch", **LINEAR_TENSORS), tmp_path, BackendOptions())
    assert backend.platform == "pytorch_libtorch"
    assert backend.inputs() == [TensorSpec("x", "FP32", (-1, 4))]
    assert [s.name for s in backend.outputs()] == ["probs", "logits"]
    x = X.copy()
    x.flags.writeable = False  # raw request bytes arrive read-only
    out = backend.infer({"x": x})
    with torch.no_grad():
        probs, logits = LinearNet(2.0).eval()(torch.from_numpy(X))
    np.testing.assert_allclose(out["probs"], probs.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["logits"], logits.numpy(), rtol=1e-5, atol=1e-6)
    backend.close()


def test_torch_default_file_prefers_pt2(tmp_path: Path) -> None:
    write_pt2(tmp_path / "model.pt2", scale=1.0)
    write_torchscript(tmp_path / "model.pt", scale=3.0)
    backend = open_backend(config("pytorch", **LINEAR_TENSORS), tmp_path, BackendOptions())
    np.testing.assert_allclose(backend.infer({"x": X})["logits"], reference(X)["logits"], rtol=1e-5)


def test_torch_needs_tensors_in_config(tmp_path: Path) -> None:
    write_torchscript(tmp_path / "model.pt")
    with pytest.raises(ModelConfigError, match=r"^input: the pytorch backend needs"):
        open_backend(config("pytorch"), tmp_path, BackendOptions())


def test_torch_wrong_output_count_or_dtype_fails_the_request(tmp_path: Path) -> None:
    write_torchscript(tmp_path / "model.pt")
    one_output = {**LINEAR_TENSORS, "output": LINEAR_TENSORS["output"][:1]}
    backend = open_backend(config("pytorch", **one_output), tmp_path, BackendOptions())
    with pytest.raises(RuntimeError, match="returned 2 tensors"):
        backend.infer({"x": X})
    fp64 = {
        **LINEAR_TENSORS,
        "output": [{"name": n, "data_type": "FP64", "dims": [3]} for n in ("probs", "logits")],
    }
    backend = open_backend(config("pytorch", **fp64), tmp_path, BackendOptions())
    with pytest.raises(RuntimeError, match=r"'probs' is float32 but config.yaml says FP64"):
        backend.infer({"x": X})


# -- pickle policy ----------------------------------------------------------------------------

MARKER = "pickle-ran.txt"


class RunsCodeWhenUnpickled:
    """Unpickling this writes a marker file: the proof that a load executed code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (self.marker, "ran"))


def test_pickled_torch_module_needs_allow_pickle(tmp_path: Path) -> None:
    torch.save(LinearNet(), tmp_path / "model.pt")
    tensors = config("pytorch", **LINEAR_TENSORS)
    with pytest.raises(ModelLoadError, match=r"pickled.*--allow-pickle"):
        open_backend(tensors, tmp_path, BackendOptions())
    backend = open_backend(tensors, tmp_path, BackendOptions(allow_pickle=True))
    np.testing.assert_allclose(backend.infer({"x": X})["logits"], reference(X)["logits"], rtol=1e-5)


@pytest.mark.parametrize("suffix", [".pkl", ".pickle", ".joblib"])
def test_pickle_files_are_refused(tmp_path: Path, suffix: str) -> None:
    (tmp_path / f"model{suffix}").write_bytes(
        pickle.dumps(RunsCodeWhenUnpickled(tmp_path / MARKER))
    )
    named = config("pytorch", default_model_filename=f"model{suffix}", **LINEAR_TENSORS)
    with pytest.raises(ModelLoadError, match=r"is a pickle file.*--allow-pickle"):
        open_backend(named, tmp_path, BackendOptions())
    assert not (tmp_path / MARKER).exists()


def _rewrite_pt2(src: Path, dst: Path, replace: dict[str, bytes]) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for name in zin.namelist():
            rel = name.split("/", 1)[1]
            zout.writestr(name, replace.get(rel, zin.read(name)))


def test_pt2_with_pickled_parts_is_refused_before_torch_reads_it(tmp_path: Path) -> None:
    write_pt2(tmp_path / "clean.pt2")
    assert pt2_pickle_reason(tmp_path / "clean.pt2") is None
    evil = pickle.dumps(RunsCodeWhenUnpickled(tmp_path / MARKER))
    # torch retries a failed weights-only load of the sample inputs with full unpickling.
    _rewrite_pt2(
        tmp_path / "clean.pt2", tmp_path / "model.pt2", {"data/sample_inputs/model.pt": evil}
    )
    with pytest.raises(ModelLoadError, match=r"sample_inputs.*--allow-pickle"):
        open_backend(config("pytorch", **LINEAR_TENSORS), tmp_path, BackendOptions())
    assert not (tmp_path / MARKER).exists()
    # The threat is real: with the check off (--allow-pickle), torch.export.load runs the code.
    with pytest.raises(ModelLoadError):
        open_backend(
            config("pytorch", **LINEAR_TENSORS), tmp_path, BackendOptions(allow_pickle=True)
        )
    assert (tmp_path / MARKER).exists()
    # A weights config that asks torch to unpickle a payload.
    with zipfile.ZipFile(tmp_path / "clean.pt2") as z:
        name = next(n for n in z.namelist() if n.endswith("_weights_config.json"))
        weights = json.loads(z.read(name))
    for payload in weights["config"].values():
        payload["use_pickle"] = True
    rel = name.split("/", 1)[1]
    _rewrite_pt2(tmp_path / "clean.pt2", tmp_path / "w.pt2", {rel: json.dumps(weights).encode()})
    assert "pickled payloads" in (pt2_pickle_reason(tmp_path / "w.pt2") or "")


# -- Python -----------------------------------------------------------------------------------


def test_python_backend_runs_the_class(tmp_path: Path) -> None:
    write_python_model(tmp_path / "3")
    cfg = config("python", parameters={"factor": 3}, **PYTHON_TENSORS)
    first = open_backend(cfg, tmp_path / "3", BackendOptions())
    second = open_backend(cfg, tmp_path / "3", BackendOptions())
    assert first.platform == "python"
    assert first.inputs() == [TensorSpec("x", "FP32", (-1, 2))]
    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    out = first.infer({"x": x})
    np.testing.assert_array_equal(out["y"], x * 3)
    # Each instance imported its own module: LOADS holds one entry in each.
    assert out["label"].tolist() == [[b"v3:1"], [b"v3:1"]]
    assert second.infer({"x": x})["label"][0, 0] == b"v3:1"
    steps: Any = first
    assert steps.preprocess_step.stage == "preprocess"
    assert steps.postprocess_step.stage == "postprocess"
    np.testing.assert_array_equal(steps.preprocess_step({"x": x})["x"], x + 1)
    np.testing.assert_array_equal(steps.postprocess_step({"y": x})["y"], x - 1)
    first.close()
    second.close()


def test_python_backend_load_errors(tmp_path: Path) -> None:
    write_python_model(tmp_path, PYTHON_MODEL)
    with pytest.raises(ModelConfigError, match=r"^input: the python backend needs"):
        open_backend(config("python"), tmp_path, BackendOptions())
    other_class = config("python", parameters={"python_class": "Nope"}, **PYTHON_TENSORS)
    with pytest.raises(ModelLoadError, match=r"no class 'Nope' \(parameters.python_class\)"):
        open_backend(other_class, tmp_path, BackendOptions())
    write_python_model(tmp_path, "import no_such_module_here\n")
    with pytest.raises(ModelLoadError, match=r"model\.py: import failed: ModuleNotFoundError"):
        open_backend(config("python", **PYTHON_TENSORS), tmp_path, BackendOptions())
    broken_init = """
        class Model:
            def initialize(self, config, version_dir):
                1 / 0

            def predict(self, inputs):
                return inputs
    """
    write_python_model(tmp_path, broken_init)
    with pytest.raises(ModelLoadError, match="failed to load: ZeroDivisionError"):
        open_backend(config("python", **PYTHON_TENSORS), tmp_path, BackendOptions())
    write_python_model(tmp_path, "class Model:\n    pass\n")
    with pytest.raises(ModelLoadError, match="has no predict"):
        open_backend(config("python", **PYTHON_TENSORS), tmp_path, BackendOptions())
