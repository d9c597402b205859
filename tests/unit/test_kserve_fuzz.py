"""Property-based fuzzing of the KServe tensor decoders: the HTTP binary tensor extension
(`Inference-Header-Content-Length` + raw tensors after the JSON) and gRPC ModelInferRequest.

Whatever the client sends, decoding returns a request or raises InvalidRequestError (HTTP 400,
gRPC INVALID_ARGUMENT), never another exception (a 500), and a body whose bytes do not match
its JSON exactly is refused rather than read short or long. Deterministic (`derandomize`).
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from inferd.errors import InvalidRequestError
from inferd.gateway.kserve import codec, grpc_codec, json_tensors, raw_request
from inferd.gateway.kserve.proto import grpc_service_pb2 as pb
from inferd.gateway.kserve.raw import decode_raw, element_size, encode_raw
from inferd.tensors import DATATYPES, InferRequest

pytestmark = pytest.mark.unit

FUZZ = settings(
    max_examples=150,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# Dimensions a client may claim: ordinary, empty, negative, past int64, past numpy's index range.
DIMS = st.one_of(
    st.integers(0, 4),
    st.integers(-3, -1),
    st.sampled_from([2**31, 2**32 + 1, 2**62, 2**63 - 1, 2**64, 2**70]),
)
SHAPES = st.lists(DIMS, max_size=5)
DATATYPE_NAMES = st.sampled_from([*json_tensors.KNOWN_DATATYPES, "FP8", "", "fp32"])
FIXED = sorted(d for d in DATATYPES if d != "BYTES")


def decodes_or_refuses(call: Any, *args: Any) -> Any:
    """The call's result, or None when it refused the input with InvalidRequestError."""
    try:
        return call(*args)
    except InvalidRequestError:
        return None


# -- HTTP: JSON + binary section -----------------------------------------------------------------


@st.composite
def binary_bodies(draw: st.DrawFn) -> tuple[bytes, str | None]:
    """A JSON header naming binary inputs with claimed sizes, then some bytes, and a header
    length that may be right, off, or not a number."""
    inputs = []
    for i in range(draw(st.integers(1, 3))):
        entry: dict[str, Any] = {"name": f"x{i}", "datatype": draw(DATATYPE_NAMES)}
        entry["shape"] = draw(SHAPES)
        size = draw(st.one_of(st.integers(0, 64), st.integers(-2, -1), st.just(2**64)))
        entry["parameters"] = {"binary_data_size": size}
        inputs.append(entry)
    header = json.dumps({"inputs": inputs}).encode()  # orjson stops at 64-bit integers
    binary = draw(st.binary(max_size=96))
    length = draw(
        st.one_of(
            st.just(str(len(header))),
            st.integers(0, len(header) + len(binary) + 4).map(str),
            st.sampled_from(["", "-1", "x", "²", " 1", "1e3", None]),
        )
    )
    return header + binary, length


_VALID_HEADER = json.dumps(
    {
        "inputs": [
            {"name": "x0", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}}
        ]
    }
).encode()


@FUZZ
@given(binary_bodies())
@example((_VALID_HEADER + bytes(8), str(len(_VALID_HEADER))))  # one that decodes, at least
def test_binary_bodies_decode_or_400(case: tuple[bytes, str | None]) -> None:
    body, header_length = case
    request = decodes_or_refuses(codec.decode_request, body, header_length, "m")
    if request is None:
        return  # refused with the protocol's InvalidRequestError (a 400), nothing else
    assert isinstance(request, InferRequest)
    # Decoded: exactly what the header declared, and the binary section used up to the byte.
    n = len(body) if header_length is None else int(header_length)
    entries = json.loads(body[:n])["inputs"]
    assert list(request.inputs) == [e["name"] for e in entries]
    for entry in entries:
        array = request.inputs[entry["name"]]
        assert list(array.shape) == entry["shape"]
        if entry["datatype"] != "BYTES":
            assert array.dtype == DATATYPES[entry["datatype"]]
            assert array.nbytes == entry["parameters"]["binary_data_size"]
    assert sum(e["parameters"]["binary_data_size"] for e in entries) == len(body) - n


@st.composite
def valid_tensors(draw: st.DrawFn) -> tuple[str, np.ndarray]:
    datatype = draw(st.sampled_from([*FIXED, "BYTES"]))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    count = math.prod(shape)
    if datatype == "BYTES":
        items = draw(st.lists(st.binary(max_size=5), min_size=count, max_size=count))
        array = np.empty(count, dtype=object)
        array[:] = items
        return datatype, array.reshape(shape)
    raw = draw(st.binary(min_size=count * 8, max_size=count * 8))
    dtype = DATATYPES[datatype]
    array = np.frombuffer(raw[: count * dtype.itemsize], dtype=dtype).reshape(shape)
    return datatype, (array.view(np.uint8) & 1).astype(bool) if datatype == "BOOL" else array


def _binary_request(datatype: str, array: np.ndarray, raw: bytes) -> tuple[bytes, str]:
    params = {"binary_data_size": len(raw)}
    entry = {"name": "x", "datatype": datatype, "shape": list(array.shape), "parameters": params}
    header = orjson.dumps({"inputs": [entry]})
    return header + raw, str(len(header))


@FUZZ
@given(valid_tensors(), st.integers(-9, 9).filter(bool))
def test_binary_round_trip_and_any_size_error_is_refused(
    tensor: tuple[str, np.ndarray], delta: int
) -> None:
    datatype, array = tensor
    raw = encode_raw(array)
    request = codec.decode_request(*_binary_request(datatype, array, raw), "m")
    np.testing.assert_array_equal(request.inputs["x"], array)
    # The same JSON over truncated or padded bytes: refused, never read short or long.
    wrong = raw[:delta] if delta < 0 else raw + b"\0" * delta
    assume(wrong != raw)
    body, length = _binary_request(datatype, array, raw)
    body = body[: int(length)] + wrong
    with pytest.raises(InvalidRequestError):
        codec.decode_request(body, length, "m")


# An empty tensor whose other dims multiply past numpy's index range (numpy raised, a 500).
ABSURD = [[0, 2**63 - 1], [0, 2**70], [2**40, 2**40, 0], [0, 2**62, 2**62]]


@FUZZ
@given(st.binary(max_size=64), SHAPES, st.sampled_from([*FIXED, "BYTES", "BF16", "?"]))
@example(b"", ABSURD[0], "FP32")
@example(b"", ABSURD[1], "BYTES")
@example(b"", ABSURD[2], "INT8")
def test_raw_tensor_bytes_decode_or_400(raw: bytes, shape: list[int], datatype: str) -> None:
    """Any bytes for any claimed shape and datatype, through the binary extension."""
    params = {"binary_data_size": len(raw)}
    entry = {"name": "x", "datatype": datatype, "shape": shape, "parameters": params}
    header = json.dumps({"inputs": [entry]}).encode()
    request = decodes_or_refuses(codec.decode_request, header + raw, str(len(header)), "m")
    if request is not None:
        assert list(request.inputs["x"].shape) == shape


@FUZZ
@given(st.lists(st.integers(0, 2**32 - 1), max_size=6), st.binary(max_size=24))
def test_bytes_length_prefixes_decode_or_400(lengths: list[int], tail: bytes) -> None:
    """BYTES elements whose 4-byte length prefixes claim anything at all."""
    raw = b"".join(struct.pack("<I", n) + tail[: n % 8] for n in lengths)
    shape = [len(lengths)]
    array = decodes_or_refuses(decode_raw, raw, "BYTES", shape, "t")
    if array is not None:
        assert encode_raw(array) == raw


@FUZZ
@given(
    st.sampled_from([*FIXED, "BYTES"]),
    st.lists(st.sampled_from([1, 2, 3, -1]), min_size=1, max_size=3),
    st.binary(max_size=40),
    st.booleans(),
)
def test_raw_binary_requests_decode_or_400(
    datatype: str, dims: list[int], body: bytes, batched: bool
) -> None:
    """`Inference-Header-Content-Length: 0`: the whole body is the single input."""
    spec = raw_request.InputSpec("x", datatype, tuple(dims), batched)
    request = decodes_or_refuses(raw_request.decode_raw_request, body, spec, "m")
    if request is not None and datatype != "BYTES":
        assert request.inputs["x"].size * element_size(datatype) == len(body)


@FUZZ
@given(
    st.sampled_from([*FIXED, "BYTES"]),
    SHAPES,
    st.recursive(
        st.one_of(st.integers(), st.floats(), st.booleans(), st.text(max_size=3), st.none()),
        lambda inner: st.lists(inner, max_size=4),
        max_leaves=12,
    ),
)
@example("FP32", ABSURD[3], [])
@example("BYTES", ABSURD[0], [])
def test_json_tensors_decode_or_400(datatype: str, shape: list[int], data: Any) -> None:
    entry = {"name": "x", "datatype": datatype, "shape": shape, "data": data}
    body = json.dumps({"inputs": [entry]}).encode()
    request = decodes_or_refuses(codec.decode_request, body, None, "m")
    if request is not None:
        assert list(request.inputs["x"].shape) == shape


# -- gRPC: ModelInferRequest ---------------------------------------------------------------------

GRPC_DIMS = st.one_of(st.integers(0, 4), st.integers(-3, -1), st.sampled_from([2**62, 2**63 - 1]))


@st.composite
def grpc_requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name=draw(st.sampled_from(["m", ""])), id="fuzz")
    n = draw(st.integers(1, 3))
    for i in range(n):
        tensor = msg.inputs.add(name=draw(st.sampled_from([f"x{i}", "", "x0"])))
        tensor.datatype = draw(DATATYPE_NAMES)
        tensor.shape.extend(draw(st.lists(GRPC_DIMS, max_size=4)))
        if draw(st.booleans()):
            tensor.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32), max_size=4)))
        if draw(st.booleans()):
            tensor.contents.bytes_contents.extend(draw(st.lists(st.binary(max_size=4), max_size=3)))
    raw_count = draw(st.sampled_from([0, n, n, n + 1, max(n - 1, 0)]))
    msg.raw_input_contents.extend(
        draw(st.lists(st.binary(max_size=48), min_size=raw_count, max_size=raw_count))
    )
    for key, value in draw(
        st.dictionaries(
            st.sampled_from(["priority", "timeout", "sequence_id"]),
            st.integers(-2, 2**63 - 1),
            max_size=2,
        )
    ).items():
        msg.parameters[key].int64_param = value
    return msg


def _grpc_example(shape: list[int], raw: bool) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name="m")
    msg.inputs.add(name="x", datatype="FP32", shape=shape)
    if raw:
        msg.raw_input_contents.append(b"")
    return msg


@FUZZ
@given(grpc_requests())
@example(_grpc_example(ABSURD[0], raw=True))
@example(_grpc_example(ABSURD[3], raw=False))
def test_grpc_requests_decode_or_invalid_argument(msg: pb.ModelInferRequest) -> None:
    request = decodes_or_refuses(grpc_codec.decode_request, msg, 0.0)
    if request is not None:
        for tensor, array in zip(msg.inputs, request.inputs.values(), strict=True):
            assert list(array.shape) == list(tensor.shape)
