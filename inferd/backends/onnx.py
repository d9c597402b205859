"""ONNX Runtime backend: one InferenceSession per instance.

Threads: `parameters.intra_op_threads` / `inter_op_threads` from config.yaml, else the server's
BackendOptions, else ONNX Runtime's default (all cores). With several instances on a small
machine, set the counts: two instances each using every core fight over the same cores.

Spinning (`parameters.allow_spinning`), decided per call by default (`auto`): a batch runs on a
session whose pool threads sleep between ops, and a lone request on an otherwise idle instance
(`infer_alone`) runs on a twin session whose threads spin between the ops of the run and stop
at its end. Waking a sleeping thread for each op cost MiniLM ~0.9 ms of a 3.9 ms call on 2
cores, which a lone request feels as latency; under load the spinning takes CPU from the event
loop and the other requests (~5 % of requests/s at 8-64 clients). The twin is a second copy of
the weights, so it is loaded only for files up to 256 MB (a larger model's ops are long enough
that a wake-up is noise). `run`: every call spins within the run; `1`: ONNX Runtime's own
default (spinning after a run too); `0`: never.
Device: `parameters.device: cuda` puts CUDAExecutionProvider first (CPU stays as the fallback
for ops CUDA lacks); asking for CUDA where onnxruntime has no CUDA provider fails the load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from inferd.backends.base import BackendOptions, TensorSpec
from inferd.errors import InvalidRequestError, ModelLoadError
from inferd.model_config import ModelRepoConfig

# ONNX Runtime type strings -> KServe datatypes.
_ORT_TYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}
_CUDA = "CUDAExecutionProvider"
# Model files up to this size get the spinning twin session under `allow_spinning: auto`.
_TWIN_MAX_BYTES = 256 << 20
# Each spelling of `allow_spinning` -> its mode.
_SPIN_MODES = {"auto": "auto", "run": "run"}
_SPIN_MODES |= dict.fromkeys(("1", "true", "yes"), "1") | dict.fromkeys(("0", "false", "no"), "0")
_CPU = "CPUExecutionProvider"


def _spec(arg: Any, path: Path, kind: str) -> TensorSpec:
    datatype = _ORT_TYPES.get(arg.type)
    if datatype is None:
        hint = " (skl2onnx classifiers: convert with options={'zipmap': False})"
        raise ModelLoadError(
            f"{path}: {kind} {arg.name!r} has type {arg.type}, which inferd cannot serve; "
            f"only tensors are supported{hint if arg.type.startswith('seq') else ''}"
        )
    # Symbolic ("batch") and unknown (None) dims both vary.
    shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in (arg.shape or ()))
    return TensorSpec(arg.name, datatype, shape)


def _providers(config: ModelRepoConfig) -> list[str]:
    device = str(config.parameters.get("device", "cpu")).lower()
    if device not in ("cpu", "cuda", "gpu"):
        raise ModelLoadError(f"parameters.device: {device!r} is not cpu or cuda")
    if device == "cpu":
        return [_CPU]
    if _CUDA not in ort.get_available_providers():
        raise ModelLoadError(
            "parameters.device: cuda requested but this onnxruntime has no "
            f"{_CUDA} (available: {ort.get_available_providers()})"
        )
    return [_CUDA, _CPU]


def _spin_mode(config: ModelRepoConfig) -> str:
    value = str(config.parameters.get("allow_spinning", "auto")).lower()
    if value not in _SPIN_MODES:
        raise ModelLoadError(f"parameters.allow_spinning: {value!r} is not auto, run, 1 or 0")
    return _SPIN_MODES[value]


def _session_options(
    config: ModelRepoConfig, options: BackendOptions, spin: str
) -> ort.SessionOptions:
    """`spin`: "0" never, "run" within a run (stopped at its end), "1" ONNX Runtime's default."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    intra = config.int_parameter("intra_op_threads") or options.intra_op_threads
    inter = config.int_parameter("inter_op_threads") or options.inter_op_threads
    if intra is not None:
        so.intra_op_num_threads = intra
    if inter is not None:
        so.inter_op_num_threads = inter
    allow = "0" if spin == "0" else "1"
    so.add_session_config_entry("session.intra_op.allow_spinning", allow)
    so.add_session_config_entry("session.inter_op.allow_spinning", allow)
    if spin == "run":
        so.add_session_config_entry("session.force_spinning_stop", "1")
    return so


def _open_session(
    path: Path, config: ModelRepoConfig, options: BackendOptions, spin: str
) -> ort.InferenceSession:
    try:
        return ort.InferenceSession(
            str(path),
            sess_options=_session_options(config, options, spin),
            providers=_providers(config),
        )
    except ModelLoadError:
        raise
    except Exception as e:  # ORT raises its own pybind types (Fail, InvalidProtobuf, ...)
        raise ModelLoadError(f"{path}: onnxruntime cannot load it: {e}") from e


def _to_ort_strings(name: str, array: np.ndarray) -> np.ndarray:
    """BYTES (object array of bytes) -> object array of str: ORT would str() a bytes object."""
    out = np.empty(array.shape, dtype=object)
    try:
        out.flat[:] = [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.flat]
    except UnicodeDecodeError as e:
        raise InvalidRequestError(f"input {name!r}: element is not UTF-8 text ({e})", name) from e
    return out


def _from_ort_strings(array: np.ndarray) -> np.ndarray:
    out = np.empty(array.shape, dtype=object)
    out.flat[:] = [v.encode("utf-8") if isinstance(v, str) else v for v in array.flat]
    return out


class OnnxBackend:
    platform = "onnxruntime_onnx"

    def __init__(self, path: Path, config: ModelRepoConfig, options: BackendOptions) -> None:
        mode = _spin_mode(config)
        twin = mode == "auto" and path.stat().st_size <= _TWIN_MAX_BYTES
        # auto: batches never spin; a large model (no twin) spins within a run, as `run` does.
        main_spin = "0" if twin else ("run" if mode == "auto" else mode)
        session = _open_session(path, config, options, main_spin)
        self._session: ort.InferenceSession | None = session
        # The session a lone request runs on: the spinning twin, else the one session.
        self._alone: ort.InferenceSession | None = (
            _open_session(path, config, options, "run") if twin else session
        )
        self._inputs = [_spec(a, path, "input") for a in session.get_inputs()]
        self._outputs = [_spec(a, path, "output") for a in session.get_outputs()]
        self._output_names = [s.name for s in self._outputs]

    def inputs(self) -> list[TensorSpec]:
        return list(self._inputs)

    def outputs(self) -> list[TensorSpec]:
        return list(self._outputs)

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._run(self._session, inputs)

    def infer_alone(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A lone request on an idle instance: on the session that spins within the run."""
        return self._run(self._alone, inputs)

    def _run(
        self, session: ort.InferenceSession | None, inputs: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        if session is None:
            raise RuntimeError("the ONNX Runtime session is closed")
        feed: dict[str, np.ndarray] = {}
        for spec in self._inputs:
            if spec.name not in inputs:
                continue  # an optional input; ORT reports it if the graph needs it
            array = inputs[spec.name]
            if spec.datatype == "BYTES":
                array = _to_ort_strings(spec.name, array)
            feed[spec.name] = array
        try:
            results = session.run(self._output_names, feed)
        except ort.capi.onnxruntime_pybind11_state.InvalidArgument as e:
            # Shapes/types the graph rejects: the request's fault, so the caller answers 400.
            raise InvalidRequestError(f"onnxruntime rejected the inputs: {e}") from e
        return {
            spec.name: _from_ort_strings(r) if spec.datatype == "BYTES" else r
            for spec, r in zip(self._outputs, results, strict=True)
        }

    def close(self) -> None:
        # The session frees its memory when the last reference goes: drop ours now rather than
        # when the unloaded ServedModel happens to be collected.
        self._session = self._alone = None
