"""The one small interface every classic-model backend implements.

    backend = open_backend(config, version_dir, options)   # inferd.backends.open_backend
    backend.inputs()   # what the model file declares (names, KServe datatypes, dims)
    out = backend.infer({"features": batch})   # batched numpy in, batched numpy out
    out = backend.infer_alone(...)   # optional (FastAlone): one request, nothing else waiting

`infer` runs on a worker thread (never the event loop); one backend object serves one
instance (config.instance_count builds that many), so it need not be thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # KServe name: "FP32", "INT64", "BYTES", ...
    shape: tuple[int, ...]  # as the model file declares it, batch dim included; -1 varies


@dataclass(frozen=True)
class BackendOptions:
    """Operator settings that apply to every model (from the CLI), not per-model config."""

    # Loading a pickle runs arbitrary code; refused unless the operator allows it.
    allow_pickle: bool = False
    # ONNX Runtime / torch threads per instance when the model's config does not say.
    intra_op_threads: int | None = None
    inter_op_threads: int | None = None


class Backend(Protocol):
    platform: str  # Triton platform string for metadata: "onnxruntime_onnx", "pytorch_libtorch"

    def inputs(self) -> list[TensorSpec]: ...

    def outputs(self) -> list[TensorSpec]: ...

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


@runtime_checkable
class FastAlone(Protocol):
    """A backend with a faster way to run a lone request on an otherwise idle instance, at a
    CPU cost it would not pay under load (ONNX Runtime: pool threads that spin)."""

    def infer_alone(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...
