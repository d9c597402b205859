"""The Open Inference Protocol over gRPC: `inference.GRPCInferenceService` (Triton's superset).

    server = await start_grpc_server(state, "0.0.0.0", 8001)    # server.port: the bound port
    ...
    await stop_grpc_server(server, grace_s=30)

A ModelInfer call's life: the proto arrives (grpc deserializes it with our private-pool class,
see proto/_pool.py) -> `decode_request` (grpc_codec.py: raw_input_contents or typed contents ->
numpy, protocol checks) -> `repository.get(model, version).infer()` (validation, batching,
backend) -> `encode_response` (grpc_codec.py: outputs always as raw_output_contents).
ModelStreamInfer runs the same path for each request of a bidirectional stream, concurrently;
responses go back in completion order, a failed request answers with `error_message` and the
stream goes on. inferd errors map to gRPC status codes in `status_of` (grpc_status.py). The standard
grpc.health.v1 service reports SERVING exactly when the server is ready.

Methods are registered with grpc's generic handlers, so no *_pb2_grpc module is needed. RPCs not
registered here (shared memory, trace and log settings) answer UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from inferd.errors import ModelNotFoundError, ModelNotReadyError
from inferd.gateway.kserve.grpc_codec import decode_request, encode_response, triton_config
from inferd.gateway.kserve.grpc_security import add_port, interceptors
from inferd.gateway.kserve.grpc_status import (
    RpcStatusError,
    Undecodable,
    decoded,
    parser,
    serialize,
    status_of,
    stream_with_status,
    with_status,
)
from inferd.gateway.kserve.image_models import Catalog, ServedImageModel
from inferd.gateway.kserve.metadata import server_metadata, stats_targets
from inferd.gateway.kserve.proto import SERVICE_NAME
from inferd.gateway.kserve.proto import grpc_service_pb2 as pb
from inferd.gateway.state import GatewayState
from inferd.telemetry.stages import Stage

if TYPE_CHECKING:
    from inferd.repository.manager import ModelRepository

logger = logging.getLogger("inferd.gateway.grpc")

# Requests of one stream being decoded/queued/run at once; past it the stream stops reading,
# so a fast producer is held back by gRPC flow control instead of piling up tasks.
MAX_STREAM_INFLIGHT = 256
# How often Watch subscribers of the health service see a readiness change.
HEALTH_REFRESH_S = 1.0
_INDEX_FIELDS = ("name", "version", "state", "reason")


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

    async def server_live(self, _: pb.ServerLiveRequest) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, _: pb.ServerReadyRequest) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.state.ready)

    async def server_metadata(self, _: pb.ServerMetadataRequest) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(**server_metadata())

    async def model_ready(self, request: pb.ModelReadyRequest) -> pb.ModelReadyResponse:
        # Like Triton: an unknown or unloaded model is simply not ready (probes need no error).
        try:
            served = Catalog(self.state).get(request.name, request.version)
        except (ModelNotFoundError, ModelNotReadyError):
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=bool(served.ready))

    async def model_metadata(self, request: pb.ModelMetadataRequest) -> pb.ModelMetadataResponse:
        meta = Catalog(self.state).metadata(request.name, request.version)
        return json_format.ParseDict(meta, pb.ModelMetadataResponse(), ignore_unknown_fields=True)

    async def model_config(self, request: pb.ModelConfigRequest) -> pb.ModelConfigResponse:
        config = Catalog(self.state).config_dict(request.name, request.version)
        return pb.ModelConfigResponse(config=triton_config(config))

    async def model_statistics(
        self, request: pb.ModelStatisticsRequest
    ) -> pb.ModelStatisticsResponse:
        targets = stats_targets(self._repository(), request.name, request.version)
        stats = self.state.model_metrics.statistics(targets)
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse())

    async def model_infer(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        arrival = time.monotonic()
        self.state.admitting()
        catalog = Catalog(self.state)
        infer_request = decode_request(request, arrival)
        # get -> infer with no await in between: a reload swapping versions cannot stop the
        # version picked here before the request is admitted to it.
        served = catalog.get(infer_request.model_name, infer_request.model_version)
        receive_s = time.monotonic() - arrival
        self.state.inflight += 1  # the HTTP drain waits on this too
        try:
            response = await served.infer(infer_request)
        finally:
            self.state.inflight -= 1
        encode_start = time.monotonic()
        response.timings.set(Stage.RECEIVE, receive_s)
        message = encode_response(response, timings=self.state.server.telemetry)
        # `stream` here is the encode only: grpc sends the bytes after the handler returns.
        stream_s = time.monotonic() - encode_start
        if not isinstance(served, ServedImageModel):  # an image request records itself
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
        entries = Catalog(self.state).index()
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
        self.state.admitting()
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
                with_status(method),
                request_deserializer=parser(request_type),
                response_serializer=serialize,
            )
            for name, method, request_type in unary
        }
        handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
            stream_with_status(self.model_stream_infer),
            request_deserializer=parser(pb.ModelInferRequest),
            response_serializer=serialize,
        )
        return handlers


# ---------------------------------------------------------------------------------------------
# Health


# grpcio ships no type information, so its base classes are Any to mypy.
class ReadinessHealth(health_aio.HealthServicer):  # type: ignore[misc]
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
