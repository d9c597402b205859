"""The gRPC side of auth.py and of TLS: the same keys, scopes, limits and certificate as HTTP.

Keys travel as metadata `authorization: Bearer <key>` (what tritonclient's `headers=` sends).
ServerLive, ServerReady and grpc.health.v1 stay open, like /v2/health on HTTP; load and unload
need the admin scope. Refusals: UNAUTHENTICATED, PERMISSION_DENIED, RESOURCE_EXHAUSTED with the
`retry-after` and `x-ratelimit-*` values as trailing metadata. A ModelStreamInfer stream is one
request of its key: it holds one concurrency slot while open.

TLS reuses --ssl-keyfile/--ssl-certfile (and --ssl-ca-certs: client certificates required).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from inferd.config import ServerConfig
from inferd.gateway.auth import Admission, Guard, Refusal
from inferd.gateway.kserve.proto import SERVICE_NAME

_OPEN = frozenset({"ServerLive", "ServerReady"})
_ADMIN = frozenset({"RepositoryModelLoad", "RepositoryModelUnload"})
_STATUS = {
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
Handler = Any  # grpc.RpcMethodHandler (untyped in grpc)


# grpcio ships no type information, so its base classes are Any to mypy.
class GuardInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Admits each call of inference.GRPCInferenceService under its key (see auth.Guard)."""

    def __init__(self, guard: Guard, on_reject: Callable[[str], None] | None = None) -> None:
        self.guard = guard
        self.on_reject = on_reject

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(details)
        service, _, name = details.method.rpartition("/")
        if handler is None or service != f"/{SERVICE_NAME}" or name in _OPEN:
            return handler
        metadata = dict(details.invocation_metadata or ())
        auth = metadata.get("authorization")
        admin = name in _ADMIN
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary, auth, admin),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._stream(handler.stream_stream, auth, admin),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    async def _admit(self, auth: Any, admin: bool, context: grpc.aio.ServicerContext) -> Admission:
        try:
            return self.guard.admit(auth if isinstance(auth, str) else None, admin=admin)
        except Refusal as refusal:
            if self.on_reject is not None:
                self.on_reject(refusal.reason)
            await context.abort(
                _STATUS[refusal.status], refusal.message, trailing_metadata=refusal.headers
            )
            raise AssertionError("context.abort returned") from None  # it always raises

    def _unary(self, inner: Any, auth: Any, admin: bool) -> Any:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            admission = await self._admit(auth, admin, context)
            try:
                return await inner(request, context)
            finally:
                admission.done()

        return call

    def _stream(self, inner: Any, auth: Any, admin: bool) -> Any:
        async def call(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            admission = await self._admit(auth, admin, context)
            try:
                async for item in inner(requests, context):
                    yield item
            finally:
                admission.done()

        return call


def interceptors(guard: Guard | None, on_reject: Callable[[str], None] | None) -> list[Any]:
    return [] if guard is None else [GuardInterceptor(guard, on_reject)]


def server_credentials(server: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from --ssl-keyfile/--ssl-certfile[/--ssl-ca-certs]; None: plain text."""
    if server.ssl_keyfile is None or server.ssl_certfile is None:
        return None
    key = Path(server.ssl_keyfile).read_bytes()
    cert = Path(server.ssl_certfile).read_bytes()
    ca = Path(server.ssl_ca_certs).read_bytes() if server.ssl_ca_certs else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


def add_port(server: grpc.aio.Server, address: str, config: ServerConfig) -> int:
    """Binds `address`, over TLS when the config has a certificate; the bound port."""
    credentials = server_credentials(config)
    if credentials is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, credentials)
