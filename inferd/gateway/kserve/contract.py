"""The Open Inference Protocol's (KServe v2) bodies as /openapi.json declares them: exactly as
strict as the real validation in codec.py and json_tensors.py (see gateway/contract.py for the
rules the document keeps).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictInt

from inferd.gateway.contract import OpenModel
from inferd.gateway.kserve.json_tensors import KNOWN_DATATYPES
from inferd.gateway.kserve.raw import MAX_RANK

Datatype = Literal[
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16",
    "FP32", "FP64", "BYTES", "BF16",
]  # fmt: skip
assert set(Datatype.__args__) == set(KNOWN_DATATYPES)  # type: ignore[attr-defined]
NonNegative = Annotated[StrictInt, Field(ge=0)]


class InputParameters(OpenModel):
    binary_data_size: NonNegative | None = Field(
        default=None, description="Bytes of this input in the binary section, in input order"
    )


class RequestInput(OpenModel):
    name: str = Field(min_length=1)
    shape: list[NonNegative] = Field(max_length=MAX_RANK)
    datatype: Datatype
    data: Any = Field(
        default=None,
        description="Row-major, flat or nested in `shape`: numbers, true/false, or strings "
        "(BYTES). Absent when parameters.binary_data_size is given.",
    )
    parameters: InputParameters | None = None


class OutputParameters(OpenModel):
    binary_data: StrictBool | None = None
    classification: NonNegative = Field(default=0, description="Top-k labels; 0: none")


class RequestOutput(OpenModel):
    name: str
    parameters: OutputParameters | None = None


class RequestParameters(OpenModel):
    priority: NonNegative = Field(default=0, description="1 is served first; 0: the default")
    timeout: NonNegative = Field(
        default=0, description="Microseconds; may only shorten the model's default"
    )
    binary_data_output: StrictBool = False


class InferenceRequest(OpenModel):
    """POST /v2/models/{model}[/versions/{version}]/infer, JSON form."""

    id: str | None = None
    parameters: RequestParameters | None = None
    inputs: list[RequestInput] = Field(min_length=1)
    outputs: list[RequestOutput] | None = None


class ResponseOutput(OpenModel):
    name: str
    datatype: str
    shape: list[int]
    data: list[Any] | None = None
    parameters: dict[str, Any] | None = None


class InferenceResponse(OpenModel):
    model_name: str
    model_version: str
    id: str
    parameters: dict[str, Any]
    outputs: list[ResponseOutput]


class ServerMetadata(OpenModel):
    name: str
    version: str
    extensions: list[str]


class ModelList(OpenModel):
    models: list[str]


class TensorMetadata(OpenModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(OpenModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class ModelReady(OpenModel):
    name: str
    ready: bool


class ModelStatistics(OpenModel):
    model_stats: list[dict[str, Any]]


class RepositoryEntry(OpenModel):
    name: str
    version: str
    state: str
    reason: str


class RepositoryIndexRequest(OpenModel):
    ready: StrictBool = Field(default=False, description="List only the ready models")


class ModelLoadRequest(OpenModel):
    parameters: dict[str, Any] | None = Field(
        default=None, description="`config` and `file:...` (inline configs/files): refused, 400"
    )


class AnyObject(OpenModel):
    """Any JSON object (its keys are ignored); `{}` as a response."""


def binary_header(description: str) -> dict[str, Any]:
    """`Inference-Header-Content-Length`, the binary tensor extension's header parameter."""
    return {
        "name": "Inference-Header-Content-Length",
        "in": "header",
        "required": False,
        "description": description,
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    }
