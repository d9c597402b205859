"""The Open Inference Protocol over gRPC: `inference.GRPCInferenceService` (Triton's superset).

    server = await start_grpc_server(state, "0.0.0.0", 8001)    # server.port: the bound port
    ...
    await stop_grpc_server(server, grace_s=30)

A ModelInfer call's life: the proto arrives (grpc deserializes it with our private-pool class,
see proto/_pool.py) -> `decode_request` (raw_input_contents or typed contents -> numpy, protocol
checks) -> `repository.get(model, version).infer()` (validation, batching, backend) ->
`encode_response` (outputs always as raw_output_contents: tritonclient decodes nothing else).
ModelStreamInfer runs the same path for each request of a bidirectional stream, concurrently;
responses go back in completion order, a failed request answers with `error_message` and the
stream goes on. inferd errors map to gRPC status codes in `status_of`. The standard
grpc.health.v1 service reports SERVING exactly when the server is ready.

Methods are registered with grpc's generic handlers, so no *_pb2_grpc module is needed. RPCs not
registered here (shared memory, trace and log settings) answer UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import numpy as np
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from inferd.errors import (
    DrainingError,
    InferdError,
    InvalidRequestError,
    ModelNotFoundError,
    ModelNotReadyError,
    QueueFullError,
    QueueTimeoutError,
)
from inferd.gateway.kserve.codec import MAX_RANK
from inferd.gateway.kserve.grpc_security import add_port, interceptors
from inferd.gateway.kserve.metadata import server_metadata, stats_targets
from inferd.gateway.kserve.proto import SERVICE_NAME
from inferd.gateway.kserve.proto import grpc_service_pb2 as pb
from inferd.gateway.kserve.proto import model_config_pb2 as mc
from inferd.gateway.kserve.raw import check_extent, decode_raw, encode_raw
from inferd.gateway.state import GatewayState
from inferd.tensors import DATATYPES, InferRequest, InferResponse, RequestedOutput

if TYPE_CHECKING:
    from inferd.repository.manager import ModelRepository

logger = logging.getLogger("inferd.gateway.grpc")

# Requests of one stream being decoded/queued/run at once; past it the stream stops reading,
# so a fast producer is held back by gRPC flow control instead of piling up tasks.
MAX_STREAM_INFLIGHT = 256
# How often Watch subscribers of the health service see a readiness change.
HEALTH_REFRESH_S = 1.0


# ---------------------------------------------------------------------------------------------
# Errors -> gRPC status


class RpcStatusError(Exception):
    """An error that is a gRPC status of its own (UNIMPLEMENTED, ...), not an inferd error."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


# First match wins; any other InferdError is INTERNAL with its message, the rest INTERNAL.
_STATUS: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (ModelNotFoundError, grpc.StatusCode.NOT_FOUND),
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ModelNotReadyError, grpc.StatusCode.UNAVAILABLE),
    (QueueTimeoutError, grpc.StatusCode.UNAVAILABLE),
    (DrainingError, grpc.StatusCode.UNAVAILABLE),
)


def status_of(err: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client gets for `err` (unexpected ones are logged)."""
    if isinstance(err, RpcStatusError):
        return err.code, str(err)
    for kind, code in _STATUS:
        if isinstance(err, kind):
            return code, str(err)
    if isinstance(err, InferdError):
        # A deliberate server-side failure (backend error, model load error): say what it was.
        logger.error("gRPC request failed: %s", err)
        return grpc.StatusCode.INTERNAL, str(err) or type(err).__name__
    logger.exception("unexpected error in a gRPC request", exc_info=err)
    return grpc.StatusCode.INTERNAL, "internal server error (see the server log)"


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
    if timings and response.timings:
        rounded = {stage: round(seconds, 6) for stage, seconds in response.timings.items()}
        msg.parameters["timings"].string_param = json.dumps(rounded)
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


# ---------------------------------------------------------------------------------------------
# The service


class InferenceService:
    """The RPCs of inference.GRPCInferenceService, over the gateway's state."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state

    def _repository(self) -> ModelRepository:
        repository = self.state.repository
        if repository is None:
            raise ModelNotFoundError("this server runs without a model repository")
        return repository

    def _admitting(self) -> None:
        if self.state.draining:
            raise DrainingError("the server is shutting down")

    async def server_live(self, _: pb.ServerLiveRequest) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, _: pb.ServerReadyRequest) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.state.ready)

    async def server_metadata(self, _: pb.ServerMetadataRequest) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(**server_metadata())

    async def model_ready(self, request: pb.ModelReadyRequest) -> pb.ModelReadyResponse:
        # Like Triton: an unknown or unloaded model is simply not ready (probes need no error).
        try:
            served = self._repository().get(request.name, request.version)
        except (ModelNotFoundError, ModelNotReadyError):
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=bool(served.ready))

    async def model_metadata(self, request: pb.ModelMetadataRequest) -> pb.ModelMetadataResponse:
        meta = self._repository().metadata(request.name, request.version)
        return json_format.ParseDict(meta, pb.ModelMetadataResponse(), ignore_unknown_fields=True)

    async def model_config(self, request: pb.ModelConfigRequest) -> pb.ModelConfigResponse:
        config = self._repository().config_dict(request.name, request.version)
        return pb.ModelConfigResponse(config=triton_config(config))

    async def model_statistics(
        self, request: pb.ModelStatisticsRequest
    ) -> pb.ModelStatisticsResponse:
        targets = stats_targets(self._repository(), request.name, request.version)
        stats = self.state.model_metrics.statistics(targets)
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse())

    async def model_infer(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        arrival = time.monotonic()
        self._admitting()
        repository = self._repository()
        infer_request = decode_request(request, arrival)
        # get -> infer with no await in between: a reload swapping versions cannot stop the
        # version picked here before the request is admitted to it.
        served = repository.get(infer_request.model_name, infer_request.model_version)
        receive_s = time.monotonic() - arrival
        self.state.inflight += 1  # the HTTP drain waits on this too
        try:
            response = await served.infer(infer_request)
        finally:
            self.state.inflight -= 1
        encode_start = time.monotonic()
        response.timings = {"receive": receive_s, **response.timings}
        message = encode_response(response, timings=self.state.server.telemetry)
        # `stream` here is the encode only: grpc sends the bytes after the handler returns.
        stream_s = time.monotonic() - encode_start
        self.state.model_metrics.observe_gateway(response.model_name, receive_s, stream_s)
        return message

    async def model_stream_infer(
        self, requests: AsyncIterator[pb.ModelInferRequest | Undecodable]
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """One response per request, in completion order; failures ride in error_message."""
        results: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        slots = asyncio.Semaphore(MAX_STREAM_INFLIGHT)
        tasks: set[asyncio.Task[None]] = set()

        async def answer(request: pb.ModelInferRequest | Undecodable) -> None:
            try:
                results.put_nowait(await self._stream_answer(request))
            finally:
                slots.release()

        async def read() -> None:
            try:
                async for request in requests:
                    await slots.acquire()
                    task = asyncio.create_task(answer(request))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                if tasks:
                    await asyncio.wait(set(tasks))
            finally:
                results.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await results.get()) is not None:
                yield item
            await reader  # re-raises a failure of the request stream itself
        finally:
            for task in (reader, *tasks):
                task.cancel()

    async def _stream_answer(
        self, request: pb.ModelInferRequest | Undecodable
    ) -> pb.ModelStreamInferResponse:
        try:
            response = await self.model_infer(decoded(request))
            return pb.ModelStreamInferResponse(infer_response=response)
        except Exception as err:
            _, message = status_of(err)
            # The id and model let the client match the error to the request it sent.
            echo = pb.ModelInferResponse()
            if not isinstance(request, Undecodable):
                echo = pb.ModelInferResponse(
                    model_name=request.model_name,
                    model_version=request.model_version,
                    id=request.id,
                )
            return pb.ModelStreamInferResponse(error_message=message, infer_response=echo)

    async def repository_index(
        self, request: pb.RepositoryIndexRequest
    ) -> pb.RepositoryIndexResponse:
        repository = self.state.repository
        entries = [] if repository is None else repository.index()
        if request.ready:
            entries = [e for e in entries if e.get("state") == "READY"]
        response = pb.RepositoryIndexResponse()
        for entry in entries:
            response.models.add(**{k: str(entry.get(k, "")) for k in _INDEX_FIELDS})
        return response

    async def repository_model_load(
        self, request: pb.RepositoryModelLoadRequest
    ) -> pb.RepositoryModelLoadResponse:
        if request.parameters:
            # Triton's "config" / "file:..." overrides (a config or files sent inline) would
            # silently not apply: the repository only loads what is on disk.
            raise RpcStatusError(
                grpc.StatusCode.UNIMPLEMENTED,
                "loading with config or file overrides is not supported; edit the repository",
            )
        self._admitting()
        await self._repository().load(request.model_name)
        return pb.RepositoryModelLoadResponse()

    async def repository_model_unload(
        self, request: pb.RepositoryModelUnloadRequest
    ) -> pb.RepositoryModelUnloadResponse:
        # Parameters (tritonclient always sends unload_dependents) are ignored: no ensembles.
        await self._repository().unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """Method name -> grpc handler, with our private-pool classes as (de)serializers."""
        unary: list[tuple[str, Callable[[Any], Awaitable[Message]], type[Message]]] = [
            ("ServerLive", self.server_live, pb.ServerLiveRequest),
            ("ServerReady", self.server_ready, pb.ServerReadyRequest),
            ("ServerMetadata", self.server_metadata, pb.ServerMetadataRequest),
            ("ModelReady", self.model_ready, pb.ModelReadyRequest),
            ("ModelMetadata", self.model_metadata, pb.ModelMetadataRequest),
            ("ModelConfig", self.model_config, pb.ModelConfigRequest),
            ("ModelStatistics", self.model_statistics, pb.ModelStatisticsRequest),
            ("ModelInfer", self.model_infer, pb.ModelInferRequest),
            ("RepositoryIndex", self.repository_index, pb.RepositoryIndexRequest),
            ("RepositoryModelLoad", self.repository_model_load, pb.RepositoryModelLoadRequest),
            (
                "RepositoryModelUnload",
                self.repository_model_unload,
                pb.RepositoryModelUnloadRequest,
            ),
        ]
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                _with_status(method),
                request_deserializer=_parser(request_type),
                response_serializer=_serialize,
            )
            for name, method, request_type in unary
        }
        handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
            _stream_with_status(self.model_stream_infer),
            request_deserializer=_parser(pb.ModelInferRequest),
            response_serializer=_serialize,
        )
        return handlers


_INDEX_FIELDS = ("name", "version", "state", "reason")
_Req = TypeVar("_Req", bound=Message)
_Resp = TypeVar("_Resp", bound=Message)


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


@dataclass(frozen=True)
class Undecodable:
    """A request whose bytes are no valid message. grpc would answer UNKNOWN for a deserializer
    that raises (and end a stream with it); the handlers refuse it as INVALID_ARGUMENT instead,
    and a stream answers it with error_message and goes on."""

    error: str


def _parser(message_type: type[_Req]) -> Callable[[bytes], _Req | Undecodable]:
    def parse(data: bytes) -> _Req | Undecodable:
        try:
            return message_type.FromString(data)
        except DecodeError as e:
            name = message_type.DESCRIPTOR.full_name
            return Undecodable(f"the request is not a valid {name} message: {e}")

    return parse


def decoded(request: _Req | Undecodable) -> _Req:
    """The message, or InvalidRequestError (INVALID_ARGUMENT) for bytes that were none."""
    if isinstance(request, Undecodable):
        raise InvalidRequestError(request.error)
    return request


def _with_status(
    method: Callable[[_Req], Awaitable[_Resp]],
) -> Callable[[_Req | Undecodable, grpc.aio.ServicerContext], Awaitable[_Resp]]:
    """Wraps an RPC so an exception becomes the gRPC status `status_of` gives it."""

    async def handler(request: _Req | Undecodable, context: grpc.aio.ServicerContext) -> _Resp:
        try:
            return await method(decoded(request))
        except Exception as err:
            code, message = status_of(err)
        await context.abort(code, message)
        raise AssertionError("context.abort returned")  # it always raises

    return handler


def _stream_with_status(
    method: Callable[[AsyncIterator[_Req]], AsyncIterator[_Resp]],
) -> Callable[[AsyncIterator[_Req], grpc.aio.ServicerContext], AsyncIterator[_Resp]]:
    """The streaming counterpart of `_with_status`, for errors of the stream itself."""

    async def handler(
        requests: AsyncIterator[_Req], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[_Resp]:
        try:
            async for item in method(requests):
                yield item
            return
        except Exception as err:
            code, message = status_of(err)
        await context.abort(code, message)

    return handler


# ---------------------------------------------------------------------------------------------
# Health


class ReadinessHealth(health_aio.HealthServicer):
    """grpc.health.v1: SERVING exactly when GatewayState.ready, for "" and our service name."""

    def __init__(self, state: GatewayState) -> None:
        super().__init__()
        self._state = state

    async def refresh(self) -> None:
        serving = health_pb2.HealthCheckResponse.ServingStatus
        status = serving.Value("SERVING") if self._state.ready else serving.Value("NOT_SERVING")
        for service in ("", SERVICE_NAME):
            await self.set(service, status)

    async def Check(  # the RPC's name, as the base servicer spells it
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        await self.refresh()  # answer from the state now, not from the last periodic refresh
        return await super().Check(request, context)

    async def refresh_forever(self, period_s: float) -> None:
        """Keeps Watch subscribers current: they hear a change within `period_s`."""
        while True:
            try:
                await self.refresh()
            except Exception:  # a failing readiness check must not end the refreshes
                logger.exception("gRPC health refresh failed")
            await asyncio.sleep(period_s)


# ---------------------------------------------------------------------------------------------
# Lifecycle


@dataclass
class GrpcServer:
    """A started gRPC server: `port` is the bound port (the real one when 0 was asked for)."""

    server: grpc.aio.Server
    port: int
    health: ReadinessHealth
    refresher: asyncio.Task[None]


async def start_grpc_server(
    state: GatewayState, host: str, port: int, max_message_bytes: int | None = None
) -> GrpcServer:
    """Builds, binds and starts the gRPC server in the running event loop.

    `max_message_bytes` bounds requests and responses (tensors travel inline); default
    state.server.grpc_max_message_bytes."""
    limit = max_message_bytes or state.server.grpc_max_message_bytes
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            # gRPC sets SO_REUSEPORT by default: a second server on a busy port would bind
            # quietly and take half the connections. Fail loudly instead.
            ("grpc.so_reuseport", 0),
        ],
        # API keys, scopes and per-key limits, as on HTTP (grpc_security.py).
        interceptors=interceptors(state.guard, state.metrics.reject),
    )
    service = InferenceService(state)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, service.handlers()),)
    )
    health = ReadinessHealth(state)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = add_port(server, address, state.server)  # TLS when --ssl-certfile is given
    except RuntimeError as err:  # grpcio raises this, older versions returned 0
        raise OSError(f"gRPC server could not bind {address}: {err}") from None
    if bound == 0:
        raise OSError(f"gRPC server could not bind {address}")
    await server.start()
    refresher = asyncio.create_task(health.refresh_forever(HEALTH_REFRESH_S))
    logger.info("gRPC (inference.GRPCInferenceService) listening on %s:%d", host, bound)
    return GrpcServer(server=server, port=bound, health=health, refresher=refresher)


async def stop_grpc_server(server: GrpcServer, grace_s: float) -> None:
    """Health turns NOT_SERVING, new RPCs are refused, in-flight ones get `grace_s` to finish."""
    server.refresher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await server.refresher
    await server.health.enter_graceful_shutdown()
    await server.server.stop(grace_s)
