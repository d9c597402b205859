"""Fuzzing the KServe tensor protocols over the wire: HTTP bodies with the binary tensor
extension, gRPC ModelInfer and ModelStreamInfer, against a real server (uvicorn and grpc.aio on
one event loop, the tiny repository of kserve_server.py).

Every malformed request gets HTTP 400 / gRPC INVALID_ARGUMENT (or NOT_FOUND for an unknown
model), never a 500/INTERNAL; a stream answers every request it was sent, then ends; the server
serves good requests after. Deterministic (`derandomize`) and bounded (`max_examples`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kserve_server import LiveServer, serve, write_repository

from inferd.gateway.kserve.grpc_server import start_grpc_server, stop_grpc_server
from inferd.gateway.kserve.proto import SERVICE_NAME
from inferd.gateway.kserve.proto import grpc_service_pb2 as pb

pytestmark = pytest.mark.integration

WIRE = settings(
    max_examples=60,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
DIMS = st.one_of(
    st.integers(0, 5),
    st.integers(-2, -1),
    st.sampled_from([2**31, 2**62, 2**63 - 1, 2**70]),
)
DATATYPES = st.sampled_from(["FP32", "FP16", "INT64", "BYTES", "BOOL", "BF16", "FP8"])
# The classifier takes x FP32 [n, 4]; echo takes text BYTES [n, 1].
TARGETS = st.sampled_from([("classifier", "x"), ("echo", "text"), ("nope", "x")])


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, int]]:
    root = write_repository(tmp_path_factory.mktemp("repo"))
    with serve(root) as server:
        grpc_server = server.call(start_grpc_server(server.state, "127.0.0.1", 0))
        try:
            yield server, grpc_server.port
        finally:
            server.call(stop_grpc_server(grpc_server, grace_s=1.0))


@pytest.fixture(scope="module")
def http(live: tuple[LiveServer, int]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live[0].url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def channel(live: tuple[LiveServer, int]) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{live[1]}") as ch:
        yield ch


def good_x(rows: int = 1) -> np.ndarray:
    return np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)


def assert_http_serves(http: httpx.Client) -> None:
    x = good_x(2)
    body = {"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "data": x.tolist()}]}
    response = http.post("/v2/models/classifier/infer", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["shape"] == [2, 3]


# -- HTTP: the binary tensor extension ------------------------------------------------------------


@st.composite
def binary_requests(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str]]:
    model, name = draw(TARGETS)
    raw = draw(st.binary(max_size=64))
    size = draw(st.sampled_from([len(raw), len(raw), 0, len(raw) + 1, max(len(raw) - 1, 0), -1]))
    entry = {
        "name": draw(st.sampled_from([name, name, "other"])),
        "shape": draw(st.lists(DIMS, max_size=3)),
        "datatype": draw(DATATYPES),
        "parameters": {"binary_data_size": size},
    }
    header = json.dumps({"inputs": [entry]}).encode()
    length = draw(
        st.sampled_from([str(len(header)), str(len(header)), "0", str(len(header) + 3), "x"])
    )
    return model, header + raw, {"Inference-Header-Content-Length": length}


@WIRE
@given(binary_requests())
def test_http_binary_tensors_get_400_never_500(
    http: httpx.Client, case: tuple[str, bytes, dict[str, str]]
) -> None:
    model, body, headers = case
    response = http.post(f"/v2/models/{model}/infer", content=body, headers=headers)
    assert response.status_code in (200, 400, 404), (response.status_code, response.text)
    if response.status_code != 200:
        assert isinstance(response.json()["error"], str)


def test_http_serves_after_fuzzing(http: httpx.Client) -> None:
    assert_http_serves(http)


# -- gRPC: ModelInfer and ModelStreamInfer ----------------------------------------------------

ANSWERS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}


@st.composite
def grpc_requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    model, name = draw(TARGETS)
    msg = pb.ModelInferRequest(model_name=model, id=f"fuzz-{draw(st.integers(0, 10**6))}")
    tensor = msg.inputs.add(name=draw(st.sampled_from([name, name, ""])))
    tensor.datatype = draw(DATATYPES)
    tensor.shape.extend(draw(st.lists(DIMS.filter(lambda d: d < 2**63), max_size=3)))
    if draw(st.booleans()):
        raws = draw(st.lists(st.binary(max_size=48), min_size=0, max_size=2))
        msg.raw_input_contents.extend(raws)
    else:
        tensor.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32), max_size=8)))
    if draw(st.booleans()):
        # BYTES elements whose 4-byte length prefixes claim anything.
        lengths = draw(st.lists(st.integers(0, 2**32 - 1), max_size=3))
        msg.raw_input_contents[:] = [b"".join(struct.pack("<I", n) + b"ab" for n in lengths)]
        del tensor.contents.fp32_contents[:]
    return msg


def good_request(rid: str) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name="classifier", id=rid)
    msg.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    msg.raw_input_contents.append(good_x().tobytes())
    return msg


def model_infer(channel: grpc.Channel) -> Any:
    return channel.unary_unary(
        f"/{SERVICE_NAME}/ModelInfer",
        request_serializer=pb.ModelInferRequest.SerializeToString,
        response_deserializer=pb.ModelInferResponse.FromString,
    )


def stream_infer(channel: grpc.Channel) -> Any:
    return channel.stream_stream(
        f"/{SERVICE_NAME}/ModelStreamInfer",
        request_serializer=pb.ModelInferRequest.SerializeToString,
        response_deserializer=pb.ModelStreamInferResponse.FromString,
    )


@WIRE
@given(grpc_requests())
def test_grpc_model_infer_invalid_argument_never_internal(
    channel: grpc.Channel, msg: pb.ModelInferRequest
) -> None:
    try:
        model_infer(channel)(msg, timeout=30)
    except grpc.RpcError as err:
        assert err.code() in ANSWERS, (err.code(), err.details())


@settings(WIRE, max_examples=12)
@given(st.lists(grpc_requests(), min_size=1, max_size=12))
def test_grpc_stream_answers_every_request_and_ends(
    channel: grpc.Channel, fuzzed: list[pb.ModelInferRequest]
) -> None:
    sent = [good_request("good-first"), *fuzzed, good_request("good-last")]
    answers = list(stream_infer(channel)(iter(sent), timeout=60))
    assert len(answers) == len(sent)
    by_id = {a.infer_response.id: a for a in answers}
    for rid in ("good-first", "good-last"):
        assert by_id[rid].error_message == "" and by_id[rid].infer_response.outputs


def truncated_message() -> bytes:
    """Bytes that are no ModelInferRequest at all (a message cut short)."""
    whole = good_request("cut").SerializeToString()
    return whole[: len(whole) - 3]


def test_grpc_undecodable_message_is_invalid_argument(channel: grpc.Channel) -> None:
    call = channel.unary_unary(f"/{SERVICE_NAME}/ModelInfer")
    with pytest.raises(grpc.RpcError) as err:
        call(truncated_message(), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()


def test_grpc_stream_answers_an_undecodable_message_and_goes_on(channel: grpc.Channel) -> None:
    call = channel.stream_stream(
        f"/{SERVICE_NAME}/ModelStreamInfer",
        response_deserializer=pb.ModelStreamInferResponse.FromString,
    )
    sent = [truncated_message(), good_request("after-garbage").SerializeToString()]
    answers = list(call(iter(sent), timeout=30))
    assert len(answers) == 2
    errors = [a.error_message for a in answers if a.error_message]
    assert len(errors) == 1 and "not a valid inference.ModelInferRequest" in errors[0]
    (good,) = [a for a in answers if not a.error_message]
    assert good.infer_response.id == "after-garbage"


def test_grpc_serves_after_fuzzing(channel: grpc.Channel, http: httpx.Client) -> None:
    response = model_infer(channel)(good_request("after"), timeout=30)
    assert response.id == "after" and list(response.outputs[0].shape) == [1, 3]
    assert_http_serves(http)
