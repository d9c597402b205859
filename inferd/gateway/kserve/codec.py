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
single input (`decode_raw_request`). A response is JSON, or a JSON header plus the raw bytes of
the outputs asked for in binary (`encode_response`).

Every malformed body raises InvalidRequestError (HTTP 400) naming what is wrong; nothing here
trusts a size, count or shape from the client before checking it against the bytes it sent.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from inferd.errors import InvalidRequestError
from inferd.gateway.kserve.raw import check_extent, decode_raw, element_size, encode_raw
from inferd.tensors import DATATYPES, InferRequest, InferResponse, RequestedOutput

HEADER_LENGTH = "Inference-Header-Content-Length"
JSON_TYPE = "application/json"
BINARY_TYPE = "application/octet-stream"
KNOWN_DATATYPES = (*DATATYPES, "BF16")
MAX_RANK = 32  # numpy's limit is 64; no served model comes near either
# Responses smaller than this are not worth compressing, whatever Accept-Encoding says.
MIN_COMPRESS_BYTES = 1024

# Kinds of numpy array (from the JSON numbers) each datatype accepts: an integer tensor takes
# integers only (1.5 is refused, not truncated), a float tensor takes integers and floats.
_ACCEPTED_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}
_KIND_WORDS = {"b": "true/false", "iu": "integers", "iuf": "numbers"}


@dataclass(frozen=True)
class InputSpec:
    """The one input a raw binary request may feed, from the model's config."""

    name: str
    datatype: str
    dims: tuple[int, ...]  # without the batch dim; -1 varies
    batched: bool  # max_batch_size > 0: the request gets a batch dim of 1


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
    datatype = _datatype(item.get("datatype"), name)
    shape = _shape(item.get("shape"), name)
    params = _object(item.get("parameters"), f"input {name!r}: parameters", name)
    if "shared_memory_region" in params:
        raise InvalidRequestError(f"input {name!r}: shared memory is not supported", name)
    size = params.get("binary_data_size")
    has_data = "data" in item
    if size is not None:
        if has_data:
            raise InvalidRequestError(
                f"input {name!r} has both 'data' and parameters.binary_data_size", name
            )
        return name, _from_binary(cursor.take(_count(size, name), name), datatype, shape, name)
    if not has_data:
        raise InvalidRequestError(
            f"input {name!r} has no 'data' and no parameters.binary_data_size", name
        )
    return name, from_json(item["data"], datatype, shape, name)


def _datatype(value: Any, name: str) -> str:
    if not isinstance(value, str) or value not in KNOWN_DATATYPES:
        raise InvalidRequestError(
            f"input {name!r}: unknown datatype {value!r}; one of {', '.join(KNOWN_DATATYPES)}",
            name,
        )
    return value


def _integer(value: Any) -> int | None:
    """A JSON integer: 2, or 2.0 (JSON Schema's `integer` includes it); None for anything else
    (1.5, "2", true)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


def _natural(value: Any) -> int | None:
    n = _integer(value)
    return n if n is not None and n >= 0 else None


def _shape(value: Any, name: str) -> list[int]:
    dims = [_integer(d) for d in value] if isinstance(value, list) else [None]
    if len(dims) > MAX_RANK or None in dims:
        raise InvalidRequestError(
            f"input {name!r}: shape must be a list of at most {MAX_RANK} integers", name
        )
    shape = [int(d or 0) for d in dims]
    if any(d < 0 for d in shape):
        raise InvalidRequestError(
            f"input {name!r}: shape {shape} has a negative dimension (-1 is only for metadata)",
            name,
        )
    check_extent(shape, name)
    return shape


def _count(value: Any, name: str) -> int:
    n = _natural(value)
    if n is None:
        raise InvalidRequestError(
            f"input {name!r}: binary_data_size must be a non-negative integer", name
        )
    return n


def _object(value: Any, what: str, param: str | None = None) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{what} must be an object", param)
    return value


def _from_binary(raw: memoryview, datatype: str, shape: list[int], name: str) -> np.ndarray:
    count = math.prod(shape)
    if datatype == "BF16":
        raise InvalidRequestError(f"input {name!r}: BF16 is not supported by inferd", name)
    if datatype == "BYTES" and count * 4 > len(raw):
        # Each element carries a 4-byte length: refuse before allocating `count` objects.
        raise InvalidRequestError(
            f"input {name!r}: {len(raw)} bytes cannot hold {count} BYTES elements", name
        )
    array = decode_raw(raw, datatype, shape, name)
    # frombuffer over the request body is read-only; steps and backends may write in place.
    return array if array.flags.writeable else array.copy()


def from_json(data: Any, datatype: str, shape: list[int], name: str) -> np.ndarray:
    """JSON tensor data, nested in the tensor's shape or flat, -> array of `shape`."""
    if datatype in ("BF16",):
        raise InvalidRequestError(
            f"input {name!r}: {datatype} cannot be sent as JSON; use binary data", name
        )
    bytes_type = datatype == "BYTES"
    flat = _json_strings(data, name) if bytes_type else _json_numbers(data, datatype, name)
    count = math.prod(shape)
    if flat.size != count:
        raise InvalidRequestError(
            f"input {name!r}: shape {shape} needs {count} elements but 'data' has {flat.size}",
            name,
        )
    return flat.reshape(shape)


def _json_numbers(data: Any, datatype: str, name: str) -> np.ndarray:
    dtype = DATATYPES[datatype]
    try:
        raw = np.asarray(data)
    except (ValueError, TypeError):
        raise InvalidRequestError(
            f"input {name!r}: 'data' is neither flat nor nested in a regular shape", name
        ) from None
    if raw.size == 0:
        return np.empty(0, dtype=dtype)
    accepted = _ACCEPTED_KINDS[dtype.kind]
    if dtype.kind in "iu" and raw.dtype.kind in "fO":
        # numpy infers float64 (or object) for integers past int64 mixed with others: retry
        # element by element so UINT64 keeps every bit (and 1.5 is still refused).
        raw = _python_ints(data, raw.shape, datatype, name)
    if raw.dtype.kind not in accepted:
        raise InvalidRequestError(
            f"input {name!r}: {datatype} data must be {_KIND_WORDS[accepted]}", name
        )
    if dtype.kind in "iu" and not _in_range(raw, dtype):
        raise InvalidRequestError(f"input {name!r}: a value is out of range for {datatype}", name)
    with np.errstate(over="ignore"):  # overflow to inf is refused just below
        out = raw.astype(dtype).reshape(-1)
    if dtype.kind == "f" and dtype.itemsize < 8 and not np.isfinite(out).all():
        raise InvalidRequestError(f"input {name!r}: a value is out of range for {datatype}", name)
    return out


def _python_ints(data: Any, shape: tuple[int, ...], datatype: str, name: str) -> np.ndarray:
    items = list(_leaves(data))
    if not all(type(v) is int for v in items):
        raise InvalidRequestError(f"input {name!r}: {datatype} data must be integers", name)
    info = np.iinfo(DATATYPES[datatype])
    if not all(info.min <= v <= info.max for v in items):
        raise InvalidRequestError(f"input {name!r}: a value is out of range for {datatype}", name)
    return np.array(items, dtype=DATATYPES[datatype]).reshape(shape)


def _in_range(raw: np.ndarray, dtype: np.dtype[Any]) -> bool:
    info = np.iinfo(dtype)
    return int(raw.min()) >= info.min and int(raw.max()) <= info.max


def _json_strings(data: Any, name: str) -> np.ndarray:
    items = []
    for item in _leaves(data):
        if not isinstance(item, str):
            raise InvalidRequestError(
                f"input {name!r}: BYTES data must be strings (send other bytes as binary data)",
                name,
            )
        try:
            items.append(item.encode())
        except UnicodeEncodeError:
            raise InvalidRequestError(
                f"input {name!r}: a string is not valid UTF-8", name
            ) from None
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


def _leaves(data: Any) -> Iterator[Any]:
    """The non-list items of nested lists, in order (no recursion: nesting depth is the
    client's choice)."""
    stack = [iter((data,))]
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
        elif isinstance(item, list):
            stack.append(iter(item))
        else:
            yield item


_END = object()


def _request_parameters(value: Any) -> dict[str, Any]:
    params = dict(_object(value, "'parameters'", "parameters"))
    if not isinstance(params.get("binary_data_output", False), bool):
        raise InvalidRequestError("parameters.binary_data_output must be true or false")
    for key in ("priority", "timeout"):
        n = _natural(params.get(key, 0))
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
    params = dict(_object(value, f"output {name!r}: parameters", name))
    if "shared_memory_region" in params:
        raise InvalidRequestError(f"output {name!r}: shared memory is not supported", name)
    binary = params.pop("binary_data", None)
    if binary is not None and not isinstance(binary, bool):
        raise InvalidRequestError(f"output {name!r}: binary_data must be true or false", name)
    k = _natural(params.pop("classification", 0))
    if k is None:
        raise InvalidRequestError(
            f"output {name!r}: classification must be a non-negative integer", name
        )
    return RequestedOutput(name=name, classification=k, binary_data=binary, parameters=params)


def raw_input_spec(config: Mapping[str, Any]) -> InputSpec:
    """The input of a model that can take a raw binary request, from its Triton-style config
    (`ModelRepository.config_dict`): exactly one input with at most one variable dim."""
    inputs = config.get("input") or []
    if len(inputs) != 1:
        raise InvalidRequestError(
            f"a raw binary request ({HEADER_LENGTH}: 0) needs a model with exactly one input; "
            f"this one has {len(inputs)}"
        )
    spec = inputs[0]
    datatype = str(spec.get("datatype") or spec.get("data_type", "")).removeprefix("TYPE_")
    datatype = "BYTES" if datatype == "STRING" else datatype
    dims = tuple(int(d) for d in spec.get("dims", ()))
    return InputSpec(str(spec["name"]), datatype, dims, int(config.get("max_batch_size", 0)) > 0)


def decode_raw_request(body: bytes, spec: InputSpec, model: str, version: str = "") -> InferRequest:
    """The whole body is one tensor of the model's single input, batch 1 when batched; its one
    variable dim (if any) follows from the byte count. Every output comes back binary."""
    if spec.dims.count(-1) > 1:
        raise InvalidRequestError(
            f"a raw binary request needs an input with at most one variable dim; "
            f"{spec.name!r} has dims {list(spec.dims)}"
        )
    bytes_type = spec.datatype == "BYTES"
    array = _raw_bytes_element(body, spec) if bytes_type else _raw_fixed(body, spec)
    if spec.batched:
        array = array.reshape((1, *array.shape))
    return InferRequest(
        model_name=model,
        model_version=version,
        inputs={spec.name: array},
        parameters={"binary_data_output": True},
    )


def _raw_bytes_element(body: bytes, spec: InputSpec) -> np.ndarray:
    # BYTES: the body is the single element itself, without the 4-byte length prefix.
    if spec.dims not in ((1,), (-1,)):
        raise InvalidRequestError(
            f"a raw binary request for BYTES input {spec.name!r} needs dims [1], "
            f"not {list(spec.dims)}"
        )
    out = np.empty(1, dtype=object)
    out[0] = bytes(body)
    return out


def _raw_fixed(body: bytes, spec: InputSpec) -> np.ndarray:
    if spec.datatype not in DATATYPES:
        raise InvalidRequestError(f"input {spec.name!r}: {spec.datatype} is not supported")
    fixed = math.prod(d for d in spec.dims if d != -1) * element_size(spec.datatype)
    shape = list(spec.dims)
    if -1 in spec.dims:
        if len(body) % fixed:
            raise InvalidRequestError(
                f"a raw binary request of {len(body)} bytes is not a whole number of "
                f"{fixed}-byte rows for input {spec.name!r} {list(spec.dims)}"
            )
        shape[shape.index(-1)] = len(body) // fixed
    return _from_binary(memoryview(body), spec.datatype, shape, spec.name)


# -- response --------------------------------------------------------------------------------


def binary_outputs(request: InferRequest) -> tuple[bool, dict[str, bool]]:
    """(the default for every output, per-output overrides) of the binary extension."""
    default = bool(request.parameters.get("binary_data_output", False))
    overrides = {o.name: o.binary_data for o in request.outputs or () if o.binary_data is not None}
    return default, overrides


def encode_response(response: InferResponse, request: InferRequest) -> EncodedResponse:
    """InferResponse -> JSON, or a JSON header + raw outputs when any output goes binary.

    The time spent encoding is added to `response.timings["stream"]` before the header is
    serialized, so the body reports it."""
    t0 = time.perf_counter()
    default, overrides = binary_outputs(request)
    outputs: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for out in response.outputs:
        entry: dict[str, Any] = {"name": out.name, "datatype": out.datatype, "shape": out.shape}
        params = dict(out.parameters)
        json_data = None if overrides.get(out.name, default) else _json_data(out.data)
        if json_data is None:
            raw = encode_raw(out.data)
            params["binary_data_size"] = len(raw)
            chunks.append(raw)
        else:
            entry["data"] = json_data
        if params:
            entry["parameters"] = params
        outputs.append(entry)
    timings = dict(response.timings)
    timings["stream"] = timings.get("stream", 0.0) + time.perf_counter() - t0
    response.timings = timings
    header = orjson.dumps(_envelope(response, outputs), option=orjson.OPT_SERIALIZE_NUMPY)
    if not chunks:
        return EncodedResponse(header, JSON_TYPE, {})
    body = b"".join((header, *chunks))
    return EncodedResponse(body, BINARY_TYPE, {HEADER_LENGTH: str(len(header))})


def _envelope(response: InferResponse, outputs: list[dict[str, Any]]) -> dict[str, Any]:
    timings = {k: round(v, 6) for k, v in response.timings.items()}
    return {
        "model_name": response.model_name,
        "model_version": response.model_version,
        "id": response.id,
        "parameters": {**response.parameters, "timings": timings},
        "outputs": outputs,
    }


def _json_data(array: np.ndarray) -> Any:
    """A flat JSON-able form of the tensor; None when JSON cannot carry it (non-UTF-8 BYTES),
    so it goes binary instead."""
    flat = np.ascontiguousarray(array).reshape(-1)
    if flat.dtype.kind not in "OSU":
        return flat  # orjson writes numpy arrays natively (OPT_SERIALIZE_NUMPY)
    items = []
    for item in flat:
        if isinstance(item, str):
            items.append(item)
            continue
        try:
            items.append(bytes(item).decode())
        except UnicodeDecodeError:
            return None
    return items


# -- compression -------------------------------------------------------------------------------


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """Undoes a request's Content-Encoding (gzip or deflate, as tritonclient sends them),
    refusing to inflate past `limit` bytes (a small body may expand enormously)."""
    name = (encoding or "identity").strip().lower()
    if name == "identity":
        return body
    wbits = {"gzip": 31, "x-gzip": 31, "deflate": 15}.get(name)
    if wbits is None:
        raise InvalidRequestError(f"unsupported Content-Encoding {encoding!r}; use gzip or deflate")
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as e:
        raise InvalidRequestError(f"the {name} request body is corrupt: {e}") from None
    if len(out) > limit:
        raise BodyTooLargeError(limit)
    if not inflater.eof:
        raise InvalidRequestError(f"the {name} request body is truncated")
    return out


class BodyTooLargeError(InvalidRequestError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the decompressed request body is larger than {limit} bytes")
        self.limit = limit


def choose_encoding(accept_encoding: str | None) -> str | None:
    """gzip or deflate when the client accepts it (q > 0), else None."""
    accepted = set()
    for part in (accept_encoding or "").split(","):
        token, _, q = part.strip().partition(";")
        q = q.strip()
        if q.startswith("q=") and _quality(q[2:]) <= 0.0:
            continue
        accepted.add(token.strip().lower())
    for name in ("gzip", "deflate"):
        if name in accepted:
            return name
    return None


def _quality(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def compress(body: bytes, encoding: str) -> bytes:
    if encoding == "gzip":
        c = zlib.compressobj(6, zlib.DEFLATED, 31)
        return c.compress(body) + c.flush()
    return zlib.compress(body, 6)
