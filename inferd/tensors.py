"""Typed messages of the classic-model path (Open Inference Protocol / KServe v2).

gateway (HTTP JSON/binary, gRPC) --InferRequest--> ModelRepository.get(m, v).infer()
    preprocess steps (per request) -> dynamic batcher -> backend.infer (batched)
    -> split per request -> postprocess steps (per request) --InferResponse--> gateway

Tensors are numpy arrays, row-major. BYTES tensors are numpy object arrays whose elements are
`bytes`. For a model with max_batch_size > 0 every tensor carries the batch dimension first
(Triton's convention: config dims exclude it, request shapes include it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inferd.telemetry.stages import StageTimings

# KServe v2 datatype -> numpy dtype (BYTES: object array of bytes).
DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}
# BF16 has no numpy dtype; it travels as raw bytes and is refused by the backends that lack it.


def datatype_of(array: np.ndarray) -> str:
    """The KServe datatype name of a numpy array (object and bytes arrays are BYTES)."""
    if array.dtype.kind in ("O", "S", "U"):
        return "BYTES"
    for name, dtype in DATATYPES.items():
        if dtype == array.dtype:
            return name
    raise ValueError(f"no KServe datatype for numpy dtype {array.dtype}")


def triton_type(datatype: str) -> str:
    """`FP32` -> `TYPE_FP32`, `BYTES` -> `TYPE_STRING` (Triton's config names)."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def from_triton_type(name: str) -> str:
    """`TYPE_FP32` -> `FP32`, `TYPE_STRING` -> `BYTES`; a KServe name passes through."""
    bare = name.removeprefix("TYPE_")
    return "BYTES" if bare == "STRING" else bare


@dataclass
class RequestedOutput:
    name: str
    # Triton's classification extension: top-k "score:index[:label]" strings instead of the tensor.
    classification: int = 0
    # HTTP binary extension: send this output as raw bytes after the JSON header.
    binary_data: bool | None = None
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class InferRequest:
    """One decoded inference request, already checked against the protocol (not the model)."""

    model_name: str
    inputs: dict[str, np.ndarray]
    id: str = ""
    model_version: str = ""  # "" -> the repository's version policy picks
    parameters: dict[str, Any] = field(default_factory=dict)
    outputs: list[RequestedOutput] | None = None  # None: every output, default settings
    priority: int = 0  # 0: the model's default priority level; 1 is the highest
    timeout_us: int = 0  # 0: the model's default queue timeout
    arrival: float = 0.0  # time.monotonic() when the gateway started receiving it


@dataclass
class OutputTensor:
    name: str
    data: np.ndarray
    datatype: str
    parameters: dict[str, Any] = field(default_factory=dict)

    @property
    def shape(self) -> list[int]:
        return list(self.data.shape)


@dataclass
class InferResponse:
    model_name: str
    model_version: str
    id: str
    outputs: list[OutputTensor]
    # Seconds per stage for this request (the per-model histograms' stages); the gateway adds
    # `receive` and `stream`, and sends `timings.as_dict()`.
    timings: StageTimings = field(default_factory=StageTimings)
    # Tokens the text preprocess produced (for /v1/embeddings usage); None for non-text models.
    num_input_tokens: int | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
