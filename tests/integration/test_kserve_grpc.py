"""The gRPC Open Inference Protocol service, driven by Triton's own client (tritonclient.grpc).

One server per module: a real ModelRepository over a temporary repository of tiny ONNX models
(built here), the gRPC server on a free port in an event loop on a background thread, and the
synchronous tritonclient in the test thread. tritonclient.grpc registers the same `inference.*`
protobuf names as our server in this process, which is part of what is tested.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import onnx
import pytest
import tritonclient.grpc as triton
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onnx import TensorProto, helper
from tritonclient.grpc import service_pb2 as triton_pb
from tritonclient.utils import InferenceServerException

from inferd.config import ServerConfig
from inferd.gateway.kserve.grpc_server import GrpcServer, start_grpc_server, stop_grpc_server
from inferd.gateway.kserve.proto import SERVICE_NAME
from inferd.gateway.kserve.proto import grpc_service_pb2 as our_pb
from inferd.gateway.state import GatewayState
from inferd.repository.manager import ModelRepository
from inferd.telemetry.metrics import ServerMetrics
from inferd.telemetry.model_metrics import ModelMetrics

pytestmark = pytest.mark.integration

LABELS = ["cat", "dog", "bird", "fish"]
T = TypeVar("T")


# -- the repository -----------------------------------------------------------------------------


def _model(
    root: Path,
    name: str,
    config: str,
    node: onnx.NodeProto,
    io: tuple[onnx.ValueInfoProto, onnx.ValueInfoProto],
    constants: tuple[onnx.TensorProto, ...] = (),
) -> None:
    """root/name/config.yaml and root/name/1/model.onnx: a one-node graph, one input, one output."""
    graph = helper.make_graph([node], name, [io[0]], [io[1]], initializer=list(constants))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # readable by every onnxruntime we support
    (root / name / "1").mkdir(parents=True)
    onnx.save(model, str(root / name / "1" / "model.onnx"))
    (root / name / "config.yaml").write_text(config)


COUNTER_CONFIG = """
backend: onnxruntime
max_batch_size: 4
input: [{name: a, data_type: TYPE_INT64, dims: [3]}]
output: [{name: b, data_type: TYPE_INT64, dims: [3]}]
"""


def build_repository(root: Path) -> Path:
    """classifier: softmax over 4 labelled classes (FP32); counter / spare: a + 1 (INT64);
    echo: BYTES identity."""
    tensor = helper.make_tensor_value_info
    _model(
        root,
        "classifier",
        """
backend: onnxruntime
max_batch_size: 8
input: [{name: x, data_type: TYPE_FP32, dims: [4]}]
output: [{name: scores, data_type: TYPE_FP32, dims: [4], label_filename: labels.txt}]
dynamic_batching: {max_queue_delay_ms: 1}
""",
        helper.make_node("Softmax", ["x"], ["scores"], axis=-1),
        (tensor("x", TensorProto.FLOAT, [None, 4]), tensor("scores", TensorProto.FLOAT, [None, 4])),
    )
    (root / "classifier" / "labels.txt").write_text("\n".join(LABELS) + "\n")
    one = helper.make_tensor("one", TensorProto.INT64, [1], [1])
    for name in ("counter", "spare"):
        _model(
            root,
            name,
            COUNTER_CONFIG,
            helper.make_node("Add", ["a", "one"], ["b"]),
            (tensor("a", TensorProto.INT64, [None, 3]), tensor("b", TensorProto.INT64, [None, 3])),
            constants=(one,),
        )
    _model(
        root,
        "echo",
        """
backend: onnxruntime
max_batch_size: 4
input: [{name: text, data_type: TYPE_STRING, dims: [1]}]
output: [{name: out, data_type: TYPE_STRING, dims: [1]}]
""",
        helper.make_node("Identity", ["text"], ["out"]),
        (
            tensor("text", TensorProto.STRING, [None, 1]),
            tensor("out", TensorProto.STRING, [None, 1]),
        ),
    )
    return root


# -- the server ---------------------------------------------------------------------------------


@dataclass
class Served:
    loop: asyncio.AbstractEventLoop
    state: GatewayState
    server: GrpcServer
    client: triton.InferenceServerClient

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = build_repository(tmp_path_factory.mktemp("repo"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[GatewayState, GrpcServer]:
        metrics = ServerMetrics()
        model_metrics = ModelMetrics(metrics.registry)
        repository = ModelRepository(root, observer=model_metrics)
        await repository.start()
        state = GatewayState(
            server=ServerConfig(access_log=False),
            metrics=metrics,
            model_metrics=model_metrics,
            repository=repository,
            serves_llm=False,
        )
        return state, await start_grpc_server(state, "127.0.0.1", 0)

    state, server = asyncio.run_coroutine_threadsafe(start(), loop).result(120)
    client = triton.InferenceServerClient(f"127.0.0.1:{server.port}")
    s = Served(loop, state, server, client)
    try:
        yield s
    finally:
        client.close()
        s.run(stop_grpc_server(server, grace_s=1.0))
        assert state.repository is not None
        s.run(state.repository.shutdown(timeout_s=5.0))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def _input(name: str, array: np.ndarray, datatype: str) -> triton.InferInput:
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# -- tests --------------------------------------------------------------------------------------


def test_our_messages_coexist_with_tritonclients() -> None:
    # Same full names, different pools: neither import broke the other, and bytes interoperate.
    assert our_pb.ModelInferRequest.DESCRIPTOR.full_name == "inference.ModelInferRequest"
    assert triton_pb.ModelInferRequest.DESCRIPTOR.full_name == "inference.ModelInferRequest"
    assert our_pb.ModelInferRequest is not triton_pb.ModelInferRequest
    theirs = triton_pb.ModelInferRequest(model_name="m", raw_input_contents=[b"\x01"])
    theirs.parameters["priority"].uint64_param = 2
    ours = our_pb.ModelInferRequest.FromString(theirs.SerializeToString())
    assert ours.model_name == "m" and ours.parameters["priority"].uint64_param == 2


def test_server_health_and_metadata(served: Served) -> None:
    client = served.client
    assert client.is_server_live()
    assert client.is_server_ready()
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "inferd"
    assert {"classification", "model_repository", "model_configuration"} <= set(meta["extensions"])
    assert client.is_model_ready("classifier")
    assert client.is_model_ready("classifier", "1")
    assert not client.is_model_ready("no-such-model")


def test_model_metadata_and_config(served: Served) -> None:
    meta = served.client.get_model_metadata("classifier", as_json=True)
    assert meta["name"] == "classifier"
    assert meta["versions"] == ["1"]
    assert meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", "4"]}]
    assert meta["outputs"] == [{"name": "scores", "datatype": "FP32", "shape": ["-1", "4"]}]

    config = served.client.get_model_config("classifier", as_json=True)["config"]
    assert config["name"] == "classifier"
    assert config["max_batch_size"] == 8
    assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": ["4"]}]
    assert config["output"][0]["label_filename"] == "labels.txt"
    assert "dynamic_batching" in config


def test_infer_fp32(served: Served) -> None:
    x = np.array([[1, 2, 3, 4], [0, 0, 0, 5]], dtype=np.float32)
    result = served.client.infer(
        "classifier", [_input("x", x, "FP32")], request_id="req-7", priority=0, timeout=10**7
    )
    np.testing.assert_allclose(result.as_numpy("scores"), _softmax(x), rtol=1e-5)
    response = result.get_response()
    assert response.id == "req-7"
    assert response.model_name == "classifier" and response.model_version == "1"
    timings = json.loads(response.parameters["timings"].string_param)
    assert {"receive", "infer"} <= set(timings)
    assert all(v >= 0 for v in timings.values())


def test_infer_int64_and_bytes(served: Served) -> None:
    a = np.array([[1, 2, 3], [-5, 0, 2**40]], dtype=np.int64)
    result = served.client.infer("counter", [_input("a", a, "INT64")])
    np.testing.assert_array_equal(result.as_numpy("b"), a + 1)

    text = np.array([[b"hello"], ["h\u00e9llo".encode()], [b""]], dtype=object)
    result = served.client.infer("echo", [_input("text", text, "BYTES")])
    assert result.as_numpy("out").tolist() == text.tolist()


def test_infer_classification(served: Served) -> None:
    x = np.array([[0.1, 3.0, 0.2, 2.0]], dtype=np.float32)
    outputs = [triton.InferRequestedOutput("scores", class_count=2)]
    result = served.client.infer("classifier", [_input("x", x, "FP32")], outputs=outputs)
    scores = _softmax(x)[0]
    expected = [f"{scores[i]:f}:{i}:{LABELS[i]}".encode() for i in (1, 3)]
    assert result.as_numpy("scores").tolist() == [expected]


def test_stream_infer_isolates_a_bad_request(served: Served) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = triton.InferenceServerClient(served.address)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i in range(5):
            x = np.full((1, 3 if i == 2 else 4), float(i), dtype=np.float32)  # #2: wrong dims
            client.async_stream_infer("classifier", [_input("x", x, "FP32")], request_id=str(i))
        got = [answers.get(timeout=30) for _ in range(5)]
    finally:
        client.stop_stream()
        client.close()
    errors = [error for result, error in got if error is not None]
    results = {r.get_response().id: r for r, error in got if error is None}
    assert len(errors) == 1 and "x" in errors[0].message()
    assert sorted(results) == ["0", "1", "3", "4"]
    for rid, result in results.items():
        np.testing.assert_allclose(result.as_numpy("scores"), [[0.25] * 4], rtol=1e-6)
        assert rid == result.get_response().id


def test_errors_map_to_status_codes(served: Served) -> None:
    x = np.zeros((1, 4), dtype=np.float32)
    with pytest.raises(InferenceServerException) as missing:
        served.client.infer("no-such-model", [_input("x", x, "FP32")])
    assert missing.value.status() == "StatusCode.NOT_FOUND"

    with pytest.raises(InferenceServerException) as bad_shape:
        served.client.infer("classifier", [_input("x", np.zeros((1, 5), np.float32), "FP32")])
    assert bad_shape.value.status() == "StatusCode.INVALID_ARGUMENT"

    with pytest.raises(InferenceServerException) as bad_type:
        served.client.infer("classifier", [_input("x", x.astype(np.float64), "FP64")])
    assert bad_type.value.status() == "StatusCode.INVALID_ARGUMENT"

    with pytest.raises(InferenceServerException) as bad_output:
        outputs = [triton.InferRequestedOutput("nope")]
        served.client.infer("classifier", [_input("x", x, "FP32")], outputs=outputs)
    assert bad_output.value.status() == "StatusCode.INVALID_ARGUMENT"

    with pytest.raises(InferenceServerException) as stats:
        served.client.get_inference_statistics("no-such-model")
    assert stats.value.status() == "StatusCode.NOT_FOUND"


def test_model_statistics(served: Served) -> None:
    x = np.zeros((2, 4), dtype=np.float32)
    before = served.client.get_inference_statistics("classifier", as_json=True)
    served.client.infer("classifier", [_input("x", x, "FP32")])
    after = served.client.get_inference_statistics("classifier", as_json=True)
    (old,), (new,) = before["model_stats"], after["model_stats"]
    assert new["name"] == "classifier" and new["version"]
    # JSON from protobuf: uint64 fields come as strings; missing ones are zero.
    success = int(new["inference_stats"]["success"]["count"])
    assert success == int(old["inference_stats"].get("success", {}).get("count", 0)) + 1
    assert int(new["inference_count"]) >= int(old.get("inference_count", 0)) + 2
    assert int(new["inference_stats"]["compute_infer"]["ns"]) > 0


def _model_infer(served: Served) -> Any:
    """ModelInfer through a bare channel with tritonclient's message classes (typed contents)."""
    channel = grpc.insecure_channel(served.address)
    return channel, channel.unary_unary(
        f"/{SERVICE_NAME}/ModelInfer",
        request_serializer=triton_pb.ModelInferRequest.SerializeToString,
        response_deserializer=triton_pb.ModelInferResponse.FromString,
    )


def _typed_request(values: list[float]) -> triton_pb.ModelInferRequest:
    request = triton_pb.ModelInferRequest(model_name="classifier", id="typed")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    tensor.contents.fp32_contents.extend(values)
    return request


def test_typed_contents_and_their_errors(served: Served) -> None:
    channel, infer = _model_infer(served)
    with channel:
        response = infer(_typed_request([1.0, 2.0, 3.0, 4.0]), timeout=30)
        # The answer is raw, as tritonclient expects, whatever the request used.
        scores = np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(1, 4)
        np.testing.assert_allclose(scores, _softmax(np.array([[1.0, 2.0, 3.0, 4.0]])), rtol=1e-5)
        assert response.outputs[0].datatype == "FP32" and list(response.outputs[0].shape) == [1, 4]

        bad = [
            _typed_request([1.0, 2.0, 3.0]),  # 3 values for shape [1, 4]
            _typed_request([1.0, 2.0, 3.0, 4.0]),  # + raw contents too: mixed
            triton_pb.ModelInferRequest(model_name="classifier"),  # no inputs
        ]
        bad[1].raw_input_contents.append(np.zeros(4, np.float32).tobytes())
        int_in_fp32 = _typed_request([])
        int_in_fp32.inputs[0].contents.int64_contents.extend([1, 2, 3, 4])
        bad.append(int_in_fp32)
        huge = triton_pb.ModelInferRequest(model_name="echo")  # claims 10^12 strings in 4 bytes
        huge.inputs.add(name="text", datatype="BYTES", shape=[10**6, 10**6])
        huge.raw_input_contents.append(b"\0\0\0\0")
        bad.append(huge)
        for request in bad:
            with pytest.raises(grpc.RpcError) as err:
                infer(request, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request

        text = triton_pb.ModelInferRequest(model_name="echo")
        text.inputs.add(name="text", datatype="BYTES", shape=[2, 1])
        text.inputs[0].contents.bytes_contents.extend([b"a", "\u00e9".encode()])
        response = infer(text, timeout=30)
        raw = response.raw_output_contents[0]
        assert raw == b"\x01\0\0\0a\x02\0\0\0\xc3\xa9"  # 4-byte little-endian lengths

        int8 = triton_pb.ModelInferRequest(model_name="counter")
        int8.inputs.add(name="a", datatype="INT8", shape=[1, 3])
        int8.inputs[0].contents.int_contents.extend([1, 2, 300])
        with pytest.raises(grpc.RpcError) as err:
            infer(int8, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "does not fit in INT8" in (err.value.details() or "")


def test_repository_index_unload_load(served: Served) -> None:
    client = served.client
    index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
    assert {"classifier", "counter", "echo", "spare"} <= set(index)
    assert index["spare"]["state"] == "READY" and index["spare"]["version"] == "1"

    a = np.zeros((1, 3), dtype=np.int64)
    client.unload_model("spare")
    assert not client.is_model_ready("spare")
    index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
    assert index["spare"]["state"] not in ("READY", "")
    with grpc.insecure_channel(served.address) as channel:  # tritonclient never asks ready=True
        ready_index = channel.unary_unary(
            f"/{SERVICE_NAME}/RepositoryIndex",
            request_serializer=triton_pb.RepositoryIndexRequest.SerializeToString,
            response_deserializer=triton_pb.RepositoryIndexResponse.FromString,
        )(triton_pb.RepositoryIndexRequest(ready=True), timeout=10)
    assert {m.name for m in ready_index.models} == {"classifier", "counter", "echo"}
    with pytest.raises(InferenceServerException) as unloaded:
        client.infer("spare", [_input("a", a, "INT64")])
    assert unloaded.value.status() == "StatusCode.UNAVAILABLE"

    client.load_model("spare")
    assert client.is_model_ready("spare")
    np.testing.assert_array_equal(
        client.infer("spare", [_input("a", a, "INT64")]).as_numpy("b"), a + 1
    )

    with pytest.raises(InferenceServerException) as unknown:
        client.load_model("no-such-model")
    assert unknown.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as override:
        client.load_model("spare", config='{"max_batch_size": 2}')
    assert override.value.status() == "StatusCode.UNIMPLEMENTED"


def test_health_follows_readiness(served: Served) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    with grpc.insecure_channel(served.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            check = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert check.status == serving
        served.state.draining = True
        try:
            check = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert check.status == not_serving
            assert not served.client.is_server_ready()
            x = np.zeros((1, 4), dtype=np.float32)
            with pytest.raises(InferenceServerException) as draining:
                served.client.infer("classifier", [_input("x", x, "FP32")])
            assert draining.value.status() == "StatusCode.UNAVAILABLE"
        finally:
            served.state.draining = False
        check = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert check.status == serving


def test_health_watch_hears_readiness_change(served: Served) -> None:
    with grpc.insecure_channel(served.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=30
        )
        try:
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            served.state.draining = True
            # The periodic refresh (HEALTH_REFRESH_S) publishes the change to watchers.
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        finally:
            served.state.draining = False
            watch.cancel()


def test_message_size_limit(served: Served) -> None:
    small = served.run(start_grpc_server(served.state, "127.0.0.1", 0, max_message_bytes=1024))
    client = triton.InferenceServerClient(f"127.0.0.1:{small.port}")
    try:
        text = np.array([[b"x" * 4096]], dtype=object)
        with pytest.raises(InferenceServerException) as too_big:
            client.infer("echo", [_input("text", text, "BYTES")])
        assert too_big.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        small_text = np.array([[b"x" * 16]], dtype=object)
        result = client.infer("echo", [_input("text", small_text, "BYTES")])
        assert result.as_numpy("out").tolist() == small_text.tolist()
    finally:
        client.close()
        served.run(stop_grpc_server(small, grace_s=1.0))
