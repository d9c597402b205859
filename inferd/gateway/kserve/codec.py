"""KServe v2 HTTP bodies <-> InferRequest / InferResponse (JSON and the binary tensor extension).

A request body is JSON, optionally followed by raw tensors:

    Inference-Header-Content-Length: 123      # absent: the whole body is JSON
    {"inputs": [{"name": "x", "shape": [2, 2], "datatype": "FP32",
                 "parameters": {"binary_data_size": 16}},          # bytes come after the JSON,
                {"name": "t", "shape": [1], "datatype": "BYTES",   # in input order
                 "data": ["hello"]}],
     "outputs": [{"name": "y", "parameters": {"binary_data": true}}],
     "parameters": {"priority": 1, "timeout": 5000}}                # timeout: microseconds
    <16 bytes of x>

`Inference-Header-Content-Length: 0` is a raw binary request: the whole body is the model's
single input (raw_request.py). A response is JSON, or a JSON header plus the raw bytes of the
outputs asked for in binary (`encode_response`). The JSON tensor data is checked in
json_tensors.py, the binary bytes in raw.py; body compression is compression.py.

Every malformed body raises InvalidRequestError (HTTP 400) naming what is wrong; nothing here
trusts a size, count or shape from the client before checking it against the bytes it sent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from inferd.errors import InvalidRequestError
from inferd.gateway.kserve.json_tensors import (
    check_datatype,
    check_shape,
    from_json,
    json_natural,
    json_object,
    to_json,
)
from inferd.gateway.kserve.raw import encode_raw, from_binary
from inferd.telemetry.stages import Stage, StageTimings
from inferd.tensors import InferRequest, InferResponse, RequestedOutput

HEADER_LENGTH = "Inference-Header-Content-Length"
JSON_TYPE = "application/json"
BINARY_TYPE = "application/octet-stream"


@dataclass(frozen=True)
class EncodedResponse:
    body: bytes
    media_type: str
    headers: dict[str, str]


# -- request ---------------------------------------------------------------------------------


def is_raw_request(header_length: str | None) -> bool:
    return header_length is not None and header_length.strip() == "0"


def decode_request(
    body: bytes, header_length: str | None, model: str, version: str = ""
) -> InferRequest:
    """A JSON (+ binary tensors) request body -> InferRequest, checked against the protocol.

    `header_length`: the Inference-Header-Content-Length header (None when absent).
    """
    json_part, binary = _split(body, header_length)
    doc = parse_json_object(json_part)
    cursor = _Cursor(binary)
    inputs = _decode_inputs(doc.get("inputs"), cursor)
    cursor.finish()
    params = _request_parameters(doc.get("parameters"))
    return InferRequest(
        model_name=model,
        model_version=version,
        inputs=inputs,
        id=_request_id(doc.get("id")),
        parameters=params,
        outputs=_requested_outputs(doc.get("outputs")),
        priority=params.get("priority", 0),
        timeout_us=params.get("timeout", 0),
    )


def _split(body: bytes, header_length: str | None) -> tuple[bytes | memoryview, memoryview]:
    view = memoryview(body)
    if header_length is None:
        return body, view[len(view) :]
    text = header_length.strip()
    if not (text.isascii() and text.isdigit()):  # "²".isdigit() is True, int("²") fails
        raise InvalidRequestError(
            f"{HEADER_LENGTH} must be a non-negative integer, got {header_length!r}"
        )
    n = int(text)
    if n > len(view):
        raise InvalidRequestError(f"{HEADER_LENGTH} is {n} but the body has only {len(view)} bytes")
    return view[:n], view[n:]


def parse_json_object(data: bytes | memoryview) -> dict[str, Any]:
    """A JSON object, or InvalidRequestError (400) for anything else."""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise InvalidRequestError(f"the request is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise InvalidRequestError("the request must be a JSON object")
    return doc


def _request_id(value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidRequestError("'id' must be a string", "id")
    return value


class _Cursor:
    """The binary section after the JSON, consumed by inputs in order."""

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int, name: str) -> memoryview:
        left = len(self.data) - self.pos
        if n > left:
            raise InvalidRequestError(
                f"input {name!r}: binary_data_size is {n} but only {left} bytes of binary data "
                f"are left after the JSON (is {HEADER_LENGTH} right?)",
                name,
            )
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def finish(self) -> None:
        left = len(self.data) - self.pos
        if left:
            raise InvalidRequestError(
                f"{left} bytes after the JSON are not claimed by any input's binary_data_size"
            )


def _decode_inputs(items: Any, cursor: _Cursor) -> dict[str, np.ndarray]:
    if not isinstance(items, list) or not items:
        raise InvalidRequestError("'inputs' must be a non-empty list of tensors", "inputs")
    out: dict[str, np.ndarray] = {}
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidRequestError(f"inputs[{i}] must be an object", "inputs")
        name, array = _decode_input(item, i, cursor)
        if name in out:
            raise InvalidRequestError(f"input {name!r} is given twice", name)
        out[name] = array
    return out


def _decode_input(item: dict[str, Any], i: int, cursor: _Cursor) -> tuple[str, np.ndarray]:
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"inputs[{i}].name must be a non-empty string", "inputs")
    datatype = check_datatype(item.get("datatype"), name)
    shape = check_shape(item.get("shape"), name)
    params = json_object(item.get("parameters"), f"input {name!r}: parameters", name)
    if "shared_memory_region" in params:
        raise InvalidRequestError(f"input {name!r}: shared memory is not supported", name)
    size = params.get("binary_data_size")
    has_data = "data" in item
    if size is not None:
        if has_data:
            raise InvalidRequestError(
                f"input {name!r} has both 'data' and parameters.binary_data_size", name
            )
        return name, from_binary(cursor.take(_count(size, name), name), datatype, shape, name)
    if not has_data:
        raise InvalidRequestError(
            f"input {name!r} has no 'data' and no parameters.binary_data_size", name
        )
    return name, from_json(item["data"], datatype, shape, name)


def _count(value: Any, name: str) -> int:
    n = json_natural(value)
    if n is None:
        raise InvalidRequestError(
            f"input {name!r}: binary_data_size must be a non-negative integer", name
        )
    return n


def _request_parameters(value: Any) -> dict[str, Any]:
    params = dict(json_object(value, "'parameters'", "parameters"))
    if not isinstance(params.get("binary_data_output", False), bool):
        raise InvalidRequestError("parameters.binary_data_output must be true or false")
    for key in ("priority", "timeout"):
        n = json_natural(params.get(key, 0))
        if n is None:
            raise InvalidRequestError(f"parameters.{key} must be a non-negative integer", key)
        if key in params:
            params[key] = n
    if params.get("sequence_id", 0) not in (0, ""):
        raise InvalidRequestError("sequence batching (parameters.sequence_id) is not supported")
    return params


def _requested_outputs(value: Any) -> list[RequestedOutput] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidRequestError("'outputs' must be a list", "outputs")
    out: list[RequestedOutput] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InvalidRequestError(f"outputs[{i}] must be an object with a 'name'", "outputs")
        out.append(_requested_output(item["name"], item.get("parameters")))
    names = [o.name for o in out]
    if len(set(names)) != len(names):
        raise InvalidRequestError(f"an output is requested twice: {names}", "outputs")
    return out


def _requested_output(name: str, value: Any) -> RequestedOutput:
    params = dict(json_object(value, f"output {name!r}: parameters", name))
    if "shared_memory_region" in params:
        raise InvalidRequestError(f"output {name!r}: shared memory is not supported", name)
    binary = params.pop("binary_data", None)
    if binary is not None and not isinstance(binary, bool):
        raise InvalidRequestError(f"output {name!r}: binary_data must be true or false", name)
    k = json_natural(params.pop("classification", 0))
    if k is None:
        raise InvalidRequestError(
            f"output {name!r}: classification must be a non-negative integer", name
        )
    return RequestedOutput(name=name, classification=k, binary_data=binary, parameters=params)


# -- response --------------------------------------------------------------------------------


def binary_outputs(request: InferRequest) -> tuple[bool, dict[str, bool]]:
    """(the default for every output, per-output overrides) of the binary extension."""
    default = bool(request.parameters.get("binary_data_output", False))
    overrides = {o.name: o.binary_data for o in request.outputs or () if o.binary_data is not None}
    return default, overrides


def encode_response(response: InferResponse, request: InferRequest) -> EncodedResponse:
    """InferResponse -> JSON, or a JSON header + raw outputs when any output goes binary.

    The time spent encoding is added to the response's `stream` timing before the header is
    serialized, so the body reports it."""
    t0 = time.perf_counter()
    default, overrides = binary_outputs(request)
    outputs: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for out in response.outputs:
        entry: dict[str, Any] = {"name": out.name, "datatype": out.datatype, "shape": out.shape}
        params = dict(out.parameters)
        json_data = None if overrides.get(out.name, default) else to_json(out.data)
        if json_data is None:
            raw = encode_raw(out.data)
            params["binary_data_size"] = len(raw)
            chunks.append(raw)
        else:
            entry["data"] = json_data
        if params:
            entry["parameters"] = params
        outputs.append(entry)
    timings = StageTimings()
    timings.merge(response.timings)  # a copy: a stopped model's worker may still write it
    timings.add(Stage.STREAM, time.perf_counter() - t0)
    response.timings = timings
    header = orjson.dumps(_envelope(response, outputs), option=orjson.OPT_SERIALIZE_NUMPY)
    if not chunks:
        return EncodedResponse(header, JSON_TYPE, {})
    body = b"".join((header, *chunks))
    return EncodedResponse(body, BINARY_TYPE, {HEADER_LENGTH: str(len(header))})


def _envelope(response: InferResponse, outputs: list[dict[str, Any]]) -> dict[str, Any]:
    timings = response.timings.as_dict()
    return {
        "model_name": response.model_name,
        "model_version": response.model_version,
        "id": response.id,
        "parameters": {**response.parameters, "timings": timings},
        "outputs": outputs,
    }
