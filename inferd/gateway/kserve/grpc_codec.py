"""ModelInfer messages <-> inferd's tensors: `decode_request` (raw_input_contents or typed
contents -> numpy, with the protocol's checks, not the model's), `encode_response` (outputs always
as raw_output_contents: tritonclient decodes nothing else), InferParameter values, and the
repository's config as Triton's ModelConfig message.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
from google.protobuf import json_format

from inferd.errors import InvalidRequestError
from inferd.gateway.kserve.proto import grpc_service_pb2 as pb
from inferd.gateway.kserve.proto import model_config_pb2 as mc
from inferd.gateway.kserve.raw import MAX_RANK, check_extent, decode_raw, encode_raw
from inferd.tensors import DATATYPES, InferRequest, InferResponse, RequestedOutput

# ---------------------------------------------------------------------------------------------
# Parameters


def param_value(param: pb.InferParameter) -> Any:
    """The Python value of an InferParameter (None when no field of its oneof is set)."""
    which = param.WhichOneof("parameter_choice")
    return None if which is None else getattr(param, which)


def set_param(param: pb.InferParameter, value: Any) -> None:
    """Stores a Python value in an InferParameter (anything else as its JSON string)."""
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int):
        if value >= 2**63:
            param.uint64_param = value
        else:
            param.int64_param = value
    elif isinstance(value, float):
        param.double_param = value
    elif isinstance(value, str):
        param.string_param = value
    else:
        param.string_param = json.dumps(value, default=str)


def _non_negative_int(params: dict[str, Any], key: str) -> int:
    value = params.get(key, 0)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequestError(f"parameter {key!r} must be a non-negative integer", key)
    return value


# ---------------------------------------------------------------------------------------------
# Request decoding

# Datatype -> the InferTensorContents field its typed values travel in. FP16/BF16 have none:
# they must be sent raw.
_TYPED_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def decode_request(msg: pb.ModelInferRequest, arrival: float) -> InferRequest:
    """A ModelInferRequest -> InferRequest, with the protocol's checks (not the model's)."""
    if not msg.model_name:
        raise InvalidRequestError("model_name is required", "model_name")
    params = {key: param_value(value) for key, value in msg.parameters.items()}
    priority = _non_negative_int(params, "priority")
    timeout_us = _non_negative_int(params, "timeout")
    if params.get("sequence_id") not in (None, 0, ""):
        raise InvalidRequestError("sequence batching (parameter sequence_id) is not supported")
    outputs = [decode_requested_output(out) for out in msg.outputs]
    return InferRequest(
        model_name=msg.model_name,
        model_version=msg.model_version,
        id=msg.id,
        inputs=decode_inputs(msg),
        parameters=params,
        outputs=outputs or None,
        priority=priority,
        timeout_us=timeout_us,
        arrival=arrival,
    )


def decode_requested_output(
    out: pb.ModelInferRequest.InferRequestedOutputTensor,
) -> RequestedOutput:
    if not out.name:
        raise InvalidRequestError("every requested output needs a name", "outputs")
    params = {key: param_value(value) for key, value in out.parameters.items()}
    params.pop("binary_data", None)  # HTTP-only: gRPC outputs are always raw
    k = params.pop("classification", 0)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise InvalidRequestError(
            f"output {out.name!r}: classification must be a non-negative integer", out.name
        )
    return RequestedOutput(name=out.name, classification=k, parameters=params)


def decode_inputs(msg: pb.ModelInferRequest) -> dict[str, np.ndarray]:
    """Every input as numpy, from raw_input_contents (one per input, in order) or typed contents."""
    raw = msg.raw_input_contents
    if not msg.inputs:
        raise InvalidRequestError("the request has no inputs", "inputs")
    if raw and any(tensor.contents.ListFields() for tensor in msg.inputs):
        raise InvalidRequestError(
            "raw_input_contents and typed contents cannot be mixed in one request", "inputs"
        )
    if raw and len(raw) != len(msg.inputs):
        raise InvalidRequestError(
            f"raw_input_contents has {len(raw)} entries for {len(msg.inputs)} inputs", "inputs"
        )
    inputs: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(msg.inputs):
        if tensor.name in inputs:
            raise InvalidRequestError(f"input {tensor.name!r} is given twice", tensor.name)
        inputs[tensor.name] = decode_input(tensor, raw[i] if raw else None)
    return inputs


def decode_input(tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None) -> np.ndarray:
    shape = list(tensor.shape)
    if not tensor.name:
        raise InvalidRequestError("every input needs a name", "inputs")
    if len(shape) > MAX_RANK or any(d < 0 for d in shape):
        raise InvalidRequestError(
            f"input {tensor.name!r}: shape {shape} must be at most {MAX_RANK} non-negative sizes",
            tensor.name,
        )
    check_extent(shape, tensor.name)
    if raw is None:
        return decode_typed(tensor, shape)
    count = math.prod(shape)
    if tensor.datatype == "BYTES" and 4 * count > len(raw):
        # Each element has a 4-byte length: refuse before anything of the claimed size exists.
        raise InvalidRequestError(
            f"input {tensor.name!r}: {len(raw)} bytes cannot hold {count} BYTES elements",
            tensor.name,
        )
    return decode_raw(raw, tensor.datatype, shape, tensor.name)


def decode_typed(tensor: pb.ModelInferRequest.InferInputTensor, shape: list[int]) -> np.ndarray:
    """Typed contents (fp32_contents, ...) -> an array of `shape`, range-checked."""
    name, datatype = tensor.name, tensor.datatype
    field = _TYPED_FIELD.get(datatype)
    if field is None:
        known = datatype in DATATYPES or datatype == "BF16"
        why = "must be sent in raw_input_contents" if known else "is not a known datatype"
        raise InvalidRequestError(f"input {name!r}: {datatype} {why}", name)
    given = [f.name for f, _ in tensor.contents.ListFields()]
    if any(g != field for g in given):
        raise InvalidRequestError(
            f"input {name!r}: {datatype} data goes in contents.{field}, got {given}", name
        )
    values = getattr(tensor.contents, field)
    count = math.prod(shape)
    if len(values) != count:
        raise InvalidRequestError(
            f"input {name!r}: shape {shape} needs {count} elements, "
            f"contents.{field} has {len(values)}",
            name,
        )
    return _typed_array(list(values), datatype, name).reshape(shape)


def _typed_array(values: list[Any], datatype: str, name: str) -> np.ndarray:
    dtype = DATATYPES[datatype]
    if datatype == "BYTES":
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out
    if dtype.kind not in "iu" or dtype.itemsize >= 4:
        # bool, floats, and ints as wide as their proto field: nothing can overflow.
        return np.asarray(values, dtype=dtype)
    # INT8/16 travel in int32, UINT8/16 in uint32 fields: reject what does not fit.
    wide = np.asarray(values, dtype=np.int64)
    info = np.iinfo(dtype)
    if wide.size and (wide.min() < info.min or wide.max() > info.max):
        raise InvalidRequestError(f"input {name!r}: a value does not fit in {datatype}", name)
    return wide.astype(dtype)


# ---------------------------------------------------------------------------------------------
# Response encoding


def encode_response(response: InferResponse, *, timings: bool = True) -> pb.ModelInferResponse:
    """InferResponse -> ModelInferResponse, every output in raw_output_contents.

    `timings` (stage -> seconds) rides along as the JSON string parameter "timings"."""
    msg = pb.ModelInferResponse(
        model_name=response.model_name, model_version=response.model_version, id=response.id
    )
    for key, value in response.parameters.items():
        set_param(msg.parameters[key], value)
    if timings and response.timings.seconds:
        msg.parameters["timings"].string_param = json.dumps(response.timings.as_dict())
    for out in response.outputs:
        tensor = msg.outputs.add(name=out.name, datatype=out.datatype, shape=out.shape)
        for key, value in out.parameters.items():
            set_param(tensor.parameters[key], value)
        msg.raw_output_contents.append(encode_raw(out.data))
    return msg


def triton_config(config: dict[str, Any]) -> mc.ModelConfig:
    """The repository's Triton-style config dict -> a ModelConfig message.

    Keys Triton's ModelConfig lacks (preprocess, embedding, ...) are dropped; `parameters` values
    become Triton's {"string_value": ...} form."""
    # A JSON round trip turns tuples into lists and anything odd into strings for ParseDict.
    data = json.loads(json.dumps(config, default=str))
    params = data.get("parameters")
    if isinstance(params, dict):
        data["parameters"] = {
            key: value if isinstance(value, dict) else {"string_value": str(value)}
            for key, value in params.items()
        }
    return json_format.ParseDict(data, mc.ModelConfig(), ignore_unknown_fields=True)
