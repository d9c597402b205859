"""KServe v2 HTTP codec: JSON and binary request bodies -> InferRequest, InferResponse -> bytes.

Binary bodies are built by tritonclient itself (generate_request_body) and responses are read
back with tritonclient's InferResult, so the wire format is checked against the real client.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from typing import Any

import numpy as np
import orjson
import pytest
import tritonclient.http as triton

from inferd.errors import InvalidRequestError
from inferd.gateway.kserve import codec, compression, raw_request
from inferd.telemetry.stages import StageTimings
from inferd.tensors import InferRequest, InferResponse, OutputTensor

pytestmark = pytest.mark.unit

NUMERIC = {
    "BOOL": np.array([[True, False], [False, True]]),
    "UINT8": np.array([[0, 255], [1, 2]], dtype=np.uint8),
    "UINT16": np.array([[0, 65535], [1, 2]], dtype=np.uint16),
    "UINT32": np.array([[0, 2**32 - 1], [1, 2]], dtype=np.uint32),
    "UINT64": np.array([[0, 2**64 - 1], [1, 2]], dtype=np.uint64),
    "INT8": np.array([[-128, 127], [0, 1]], dtype=np.int8),
    "INT16": np.array([[-(2**15), 2**15 - 1], [0, 1]], dtype=np.int16),
    "INT32": np.array([[-(2**31), 2**31 - 1], [0, 1]], dtype=np.int32),
    "INT64": np.array([[-(2**63), 2**63 - 1], [0, 1]], dtype=np.int64),
    "FP16": np.array([[0.5, -1.25], [65504.0, 0.0]], dtype=np.float16),
    "FP32": np.array([[0.1, -2.5], [3.0e38, 0.0]], dtype=np.float32),
    "FP64": np.array([[0.1, -2.5], [1e300, 0.0]], dtype=np.float64),
}


def json_body(inputs: list[dict[str, Any]], **extra: Any) -> bytes:
    return orjson.dumps({"inputs": inputs, **extra})


def decode(body: bytes, header_length: str | None = None) -> InferRequest:
    return codec.decode_request(body, header_length, "m")


def tensor(name: str = "x", **kw: Any) -> dict[str, Any]:
    return {"name": name, "shape": [2], "datatype": "FP32", "data": [1.0, 2.0], **kw}


# -- JSON requests -----------------------------------------------------------------------------


@pytest.mark.parametrize("datatype", sorted(NUMERIC))
def test_json_numbers_every_datatype_nested_and_flat(datatype: str) -> None:
    expected = NUMERIC[datatype]
    for data in (expected.tolist(), expected.reshape(-1).tolist()):
        req = decode(
            json_body([{"name": "x", "shape": [2, 2], "datatype": datatype, "data": data}])
        )
        got = req.inputs["x"]
        assert got.dtype == expected.dtype and got.shape == (2, 2)
        np.testing.assert_array_equal(got, expected)


def test_json_bytes_are_utf8_encoded_strings() -> None:
    item = {"name": "t", "shape": [2, 1], "datatype": "BYTES", "data": [["héllo"], [""]]}
    got = decode(json_body([item])).inputs["t"]
    assert got.dtype == object and got.shape == (2, 1)
    assert got.reshape(-1).tolist() == ["héllo".encode(), b""]


def test_json_integers_are_accepted_for_float_tensors() -> None:
    got = decode(json_body([tensor(data=[1, 2])])).inputs["x"]
    assert got.dtype == np.float32 and got.tolist() == [1.0, 2.0]


def test_empty_tensor() -> None:
    got = decode(json_body([tensor(shape=[0, 3], data=[])])).inputs["x"]
    assert got.shape == (0, 3) and got.dtype == np.float32


def test_request_fields_parameters_and_outputs() -> None:
    body = json_body(
        [tensor()],
        id="abc",
        parameters={"priority": 2, "timeout": 5000, "binary_data_output": True, "custom": "v"},
        outputs=[
            {"name": "probs", "parameters": {"classification": 3}},
            {"name": "raw", "parameters": {"binary_data": False, "extra": 1}},
        ],
    )
    req = codec.decode_request(body, None, "m", "2")
    assert (req.model_name, req.model_version, req.id) == ("m", "2", "abc")
    assert (req.priority, req.timeout_us) == (2, 5000)
    assert req.parameters["custom"] == "v" and req.parameters["binary_data_output"] is True
    assert req.outputs is not None
    probs, raw = req.outputs
    assert (probs.name, probs.classification, probs.binary_data) == ("probs", 3, None)
    assert (raw.name, raw.binary_data, raw.parameters) == ("raw", False, {"extra": 1})


# -- binary extension (bodies made by tritonclient) ------------------------------------------


def triton_body(arrays: dict[str, np.ndarray], binary: bool = True, **kw: Any) -> tuple[bytes, Any]:
    inputs = []
    for name, array in arrays.items():
        datatype = "BYTES" if array.dtype == object else triton.np_to_triton_dtype(array.dtype)
        inp = triton.InferInput(name, list(array.shape), datatype)
        inp.set_data_from_numpy(array, binary_data=binary)
        inputs.append(inp)
    body, json_size = triton.InferenceServerClient.generate_request_body(inputs, **kw)
    return body, json_size


@pytest.mark.parametrize("datatype", sorted(NUMERIC))
def test_binary_round_trip_every_datatype(datatype: str) -> None:
    arrays = {"x": NUMERIC[datatype], "y": np.array([b"a\x00b", b"\xff"], dtype=object)}
    body, size = triton_body(arrays)
    req = decode(body, str(size))
    np.testing.assert_array_equal(req.inputs["x"], arrays["x"])
    assert req.inputs["x"].dtype == arrays["x"].dtype
    assert req.inputs["y"].tolist() == [b"a\x00b", b"\xff"]
    assert req.inputs["x"].flags.writeable


def test_tritonclient_json_body_and_request_parameters() -> None:
    body, size = triton_body(
        {"x": NUMERIC["FP32"], "s": np.array([b"hi"], dtype=object)},
        binary=False,
        request_id="r1",
        priority=3,
        timeout=100,
    )
    assert size is None
    req = decode(body)
    np.testing.assert_array_equal(req.inputs["x"], NUMERIC["FP32"])
    assert req.inputs["s"].tolist() == [b"hi"]
    assert (req.id, req.priority, req.timeout_us) == ("r1", 3, 100)
    # tritonclient asks for binary outputs when it names none.
    assert req.parameters["binary_data_output"] is True and req.outputs is None


def test_mixed_json_and_binary_inputs() -> None:
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    header = orjson.dumps(
        {
            "inputs": [
                {"name": "a", "shape": [1], "datatype": "FP32", "data": [0.5]},
                {
                    "name": "x",
                    "shape": [2, 3],
                    "datatype": "INT32",
                    "parameters": {"binary_data_size": 24},
                },
            ]
        }
    )
    req = decode(header + x.tobytes(), str(len(header)))
    np.testing.assert_array_equal(req.inputs["x"], x)
    assert req.inputs["a"].tolist() == [0.5]


# -- raw binary requests ----------------------------------------------------------------------


def test_raw_request_fills_the_variable_dim_and_adds_batch() -> None:
    spec = raw_request.raw_input_spec(
        {"max_batch_size": 8, "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [-1, 2]}]}
    )
    data = np.arange(6, dtype=np.float32)
    req = raw_request.decode_raw_request(data.tobytes(), spec, "m")
    assert req.inputs["x"].shape == (1, 3, 2)
    np.testing.assert_array_equal(req.inputs["x"].reshape(-1), data)
    assert req.parameters["binary_data_output"] is True


def test_raw_request_bytes_input_is_one_element() -> None:
    spec = raw_request.raw_input_spec(
        {"input": [{"name": "img", "data_type": "TYPE_STRING", "dims": [1]}]}
    )
    req = raw_request.decode_raw_request(b"\x89PNG...", spec, "m")
    assert req.inputs["img"].shape == (1,) and req.inputs["img"][0] == b"\x89PNG..."


@pytest.mark.parametrize(
    ("config", "body", "message"),
    [
        ({"input": [{"name": "a", "dims": [1]}, {"name": "b", "dims": [1]}]}, b"", "exactly one"),
        ({"input": [{"name": "x", "data_type": "FP32", "dims": [-1, -1]}]}, b"", "one variable"),
        ({"input": [{"name": "x", "data_type": "FP32", "dims": [-1, 2]}]}, b"1234567", "whole"),
        ({"input": [{"name": "x", "data_type": "FP32", "dims": [2]}]}, b"1234", "expected 8"),
        ({"input": [{"name": "x", "data_type": "BYTES", "dims": [2]}]}, b"ab", r"dims \[1\]"),
    ],
)
def test_raw_request_errors(config: dict[str, Any], body: bytes, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        raw_request.decode_raw_request(body, raw_request.raw_input_spec(config), "m")


def test_raw_request_is_recognized_by_a_zero_header_length() -> None:
    assert codec.is_raw_request("0") and codec.is_raw_request(" 0 ")
    assert not codec.is_raw_request(None) and not codec.is_raw_request("10")


# -- malformed requests -----------------------------------------------------------------------

BAD_JSON = [
    (b"{not json", None, "not valid JSON"),
    (b'{"inputs": [\xff]}', None, "not valid JSON"),  # invalid UTF-8
    (b"[1, 2]", None, "JSON object"),
    (json_body([]), None, "non-empty list"),
    (orjson.dumps({"inputs": "x"}), None, "non-empty list"),
    (json_body([{"shape": [1], "datatype": "FP32", "data": [1]}]), None, "name"),
    (json_body([tensor(shape=[3])]), None, r"shape \[3\] needs 3 elements but 'data' has 2"),
    (json_body([tensor(shape=[2, -1])]), None, "negative"),
    (json_body([tensor(shape="2")]), None, "shape must be a list"),
    (json_body([tensor(shape=[True, 2])]), None, "shape must be a list"),
    (json_body([tensor(shape=[1] * 40, data=[1.0])]), None, "at most"),
    (json_body([{"name": "x", "shape": [2], "data": [1, 2]}]), None, "unknown datatype None"),
    (json_body([tensor(datatype="FLOAT")]), None, "unknown datatype 'FLOAT'"),
    (json_body([{"name": "x", "shape": [2], "datatype": "FP32"}]), None, "no 'data'"),
    (json_body([tensor(datatype="BF16")]), None, "binary"),
    (json_body([tensor(datatype="INT32", data=[1.5, 2])]), None, "must be integers"),
    (json_body([tensor(datatype="INT32", data=[1, "2"])]), None, "must be integers"),
    (json_body([tensor(datatype="UINT8", data=[1, 256])]), None, "out of range for UINT8"),
    (json_body([tensor(datatype="UINT32", data=[1, -1])]), None, "out of range for UINT32"),
    (json_body([tensor(datatype="BOOL", data=[1, 0])]), None, "true/false"),
    (json_body([tensor(data=["1.0", "2.0"])]), None, "must be numbers"),
    (json_body([tensor(data=[1.0, None])]), None, "must be numbers"),
    (json_body([tensor(data={"a": 1})]), None, "must be numbers"),
    (json_body([tensor(datatype="FP16", data=[1.0, 1e6])]), None, "out of range for FP16"),
    (json_body([tensor(shape=[3], data=[[1.0], [2.0, 3.0]])]), None, "regular shape"),
    (json_body([tensor(datatype="BYTES", data=["a", 1])]), None, "must be strings"),
    (json_body([tensor(), tensor()]), None, "given twice"),
    (json_body([tensor(parameters={"shared_memory_region": "r"})]), None, "shared memory"),
    (json_body([tensor(parameters=[1])]), None, "parameters must be an object"),
    (json_body([tensor()], id=5), None, "'id' must be a string"),
    (json_body([tensor()], parameters={"priority": -1}), None, "priority"),
    (json_body([tensor()], parameters={"timeout": 1.5}), None, "timeout"),
    (json_body([tensor()], parameters={"binary_data_output": "yes"}), None, "binary_data_output"),
    (json_body([tensor()], parameters={"sequence_id": 7}), None, "sequence"),
    (json_body([tensor()], outputs={"name": "y"}), None, "'outputs' must be a list"),
    (json_body([tensor()], outputs=[{"parameters": {}}]), None, "'name'"),
    (json_body([tensor()], outputs=[{"name": "y"}, {"name": "y"}]), None, "twice"),
    (
        json_body([tensor()], outputs=[{"name": "y", "parameters": {"classification": -1}}]),
        None,
        "classification",
    ),
    (
        json_body([tensor()], outputs=[{"name": "y", "parameters": {"binary_data": 1}}]),
        None,
        "binary_data must be",
    ),
]


@pytest.mark.parametrize(("body", "header", "message"), BAD_JSON)
def test_malformed_json_requests(body: bytes, header: str | None, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        decode(body, header)


def binary_request(size_claimed: int, payload: bytes, shape: list[int], datatype: str) -> bytes:
    params = {"binary_data_size": size_claimed}
    header = json_body([{"name": "x", "shape": shape, "datatype": datatype, "parameters": params}])
    return header + payload


@pytest.mark.parametrize(
    ("body_fn", "message"),
    [
        # payload shorter than binary_data_size
        (lambda: binary_request(16, b"\x00" * 8, [4], "FP32"), "only 8 bytes"),
        # binary_data_size disagrees with the shape
        (lambda: binary_request(8, b"\x00" * 8, [4], "FP32"), "expected 16 bytes"),
        # bytes left over after every input
        (lambda: binary_request(16, b"\x00" * 20, [4], "FP32"), "4 bytes after the JSON"),
        # a huge BYTES shape with a tiny payload is refused before allocating
        (lambda: binary_request(8, b"\x00" * 8, [10**12], "BYTES"), "cannot hold"),
        # a BYTES element that claims more bytes than there are
        (
            lambda: binary_request(8, struct.pack("<I", 100) + b"abcd", [1], "BYTES"),
            "past the end",
        ),
        (lambda: binary_request(-1, b"", [1], "FP32"), "non-negative"),
        (lambda: binary_request(2, b"\x00\x00", [1], "BF16"), "BF16"),
        (lambda: binary_request(2, b"\x02\x00", [2], "BOOL"), "0 or 1"),
    ],
)
def test_malformed_binary_requests(body_fn: Any, message: str) -> None:
    body = body_fn()
    header_len = body.index(b"}]}") + 3
    with pytest.raises(InvalidRequestError, match=message):
        decode(body, str(header_len))


def test_binary_data_without_header_length_is_short() -> None:
    with pytest.raises(InvalidRequestError, match="only 0 bytes"):
        decode(binary_request(4, b"", [1], "FP32"))


def test_data_and_binary_size_together() -> None:
    body = json_body([tensor(parameters={"binary_data_size": 8})])
    with pytest.raises(InvalidRequestError, match="both"):
        decode(body, str(len(body)))


@pytest.mark.parametrize(
    ("header", "message"),
    [("abc", "non-negative integer"), ("-3", "non-negative"), ("999", "only")],
)
def test_bad_header_length(header: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        decode(json_body([tensor()]), header)


def test_errors_name_the_input() -> None:
    with pytest.raises(InvalidRequestError) as info:
        decode(json_body([tensor(name="features", shape=[5])]))
    assert info.value.param == "features" and "'features'" in str(info.value)


# -- responses ---------------------------------------------------------------------------------


def response(*outputs: OutputTensor) -> InferResponse:
    return InferResponse(
        "m", "1", "id-1", list(outputs), timings=StageTimings.from_mapping({"infer": 0.001})
    )


def request(**params: Any) -> InferRequest:
    return InferRequest("m", {}, parameters=params)


def test_encode_json_outputs_flat_with_timings() -> None:
    probs = np.array([[0.25, 0.75]], dtype=np.float32)
    labels = np.array([[b"0.750000:1:cat"]], dtype=object)
    enc = codec.encode_response(
        response(OutputTensor("probs", probs, "FP32"), OutputTensor("top", labels, "BYTES")),
        request(),
    )
    assert enc.media_type == "application/json" and enc.headers == {}
    doc = orjson.loads(enc.body)
    assert (doc["model_name"], doc["model_version"], doc["id"]) == ("m", "1", "id-1")
    out = {o["name"]: o for o in doc["outputs"]}
    assert out["probs"] == {
        "name": "probs",
        "datatype": "FP32",
        "shape": [1, 2],
        "data": [0.25, 0.75],
    }
    assert out["top"]["data"] == ["0.750000:1:cat"]
    assert set(doc["parameters"]["timings"]) == {"infer", "stream"}
    result = triton.InferResult.from_response_body(enc.body)
    np.testing.assert_array_equal(result.as_numpy("probs"), probs)


@pytest.mark.parametrize("datatype", sorted(NUMERIC))
def test_encode_binary_every_datatype_read_by_tritonclient(datatype: str) -> None:
    array = NUMERIC[datatype]
    strings = np.array([b"\xff\x00", b"ok"], dtype=object)
    enc = codec.encode_response(
        response(OutputTensor("y", array, datatype), OutputTensor("s", strings, "BYTES")),
        request(binary_data_output=True),
    )
    assert enc.media_type == "application/octet-stream"
    size = int(enc.headers[codec.HEADER_LENGTH])
    header = orjson.loads(enc.body[:size])
    assert header["outputs"][0]["parameters"]["binary_data_size"] == array.nbytes
    result = triton.InferResult.from_response_body(enc.body, header_length=size)
    np.testing.assert_array_equal(result.as_numpy("y"), array)
    assert result.as_numpy("s").tolist() == [b"\xff\x00", b"ok"]


def test_per_output_binary_overrides_the_default() -> None:
    req = decode(
        json_body(
            [tensor()],
            parameters={"binary_data_output": True},
            outputs=[{"name": "a", "parameters": {"binary_data": False}}, {"name": "b"}],
        )
    )
    a = OutputTensor("a", np.array([1, 2], dtype=np.int64), "INT64")
    b = OutputTensor("b", np.array([3], dtype=np.int64), "INT64")
    enc = codec.encode_response(response(a, b), req)
    size = int(enc.headers[codec.HEADER_LENGTH])
    outs = {o["name"]: o for o in orjson.loads(enc.body[:size])["outputs"]}
    assert outs["a"]["data"] == [1, 2] and "parameters" not in outs["a"]
    assert outs["b"]["parameters"] == {"binary_data_size": 8}
    assert enc.body[size:] == np.array([3], dtype="<i8").tobytes()


def test_non_utf8_bytes_output_goes_binary_even_in_json_mode() -> None:
    bad = OutputTensor("s", np.array([b"\xff"], dtype=object), "BYTES")
    enc = codec.encode_response(response(bad), request())
    assert enc.media_type == "application/octet-stream"
    result = triton.InferResult.from_response_body(
        enc.body, header_length=int(enc.headers[codec.HEADER_LENGTH])
    )
    assert result.as_numpy("s").tolist() == [b"\xff"]


# -- compression -------------------------------------------------------------------------------


def test_decompress_gzip_and_deflate() -> None:
    body = b'{"inputs": []}' * 10
    assert compression.decompress(gzip.compress(body), "gzip", 1000) == body
    assert compression.decompress(zlib.compress(body), "deflate", 1000) == body
    assert compression.decompress(body, None, 1000) == body


def test_decompress_refuses_bombs_corrupt_and_unknown() -> None:
    bomb = gzip.compress(b"\x00" * 100_000)
    with pytest.raises(compression.BodyTooLargeError):
        compression.decompress(bomb, "gzip", 1000)
    with pytest.raises(InvalidRequestError, match="corrupt"):
        compression.decompress(b"not gzip at all", "gzip", 1000)
    with pytest.raises(InvalidRequestError, match="truncated"):
        compression.decompress(gzip.compress(b"abc" * 100)[:-12], "gzip", 1000)
    with pytest.raises(InvalidRequestError, match="unsupported"):
        compression.decompress(b"x", "br", 1000)


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("gzip", "gzip"),
        ("deflate, gzip;q=0.5", "gzip"),
        ("gzip;q=0, deflate", "deflate"),
        ("br", None),
        (None, None),
    ],
)
def test_choose_encoding(header: str | None, expected: str | None) -> None:
    assert compression.choose_encoding(header) == expected


def test_compress_round_trips() -> None:
    body = b"x" * 5000
    assert gzip.decompress(compression.compress(body, "gzip")) == body
    assert zlib.decompress(compression.compress(body, "deflate")) == body
