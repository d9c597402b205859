"""How an RPC fails: inferd errors -> gRPC status codes (`status_of`), and the wrappers that
turn a servicer method into a grpc handler whose exceptions become those statuses, with request
bytes that are no valid message refused as INVALID_ARGUMENT (`Undecodable`) instead of grpc's
UNKNOWN.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from inferd.errors import (
    DrainingError,
    InferdError,
    InvalidRequestError,
    ModelNotFoundError,
    ModelNotReadyError,
    QueueFullError,
    QueueTimeoutError,
)

logger = logging.getLogger("inferd.gateway.grpc")


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
# Handlers

_Req = TypeVar("_Req", bound=Message)
_Resp = TypeVar("_Resp", bound=Message)


def serialize(message: Message) -> bytes:
    return message.SerializeToString()


@dataclass(frozen=True)
class Undecodable:
    """A request whose bytes are no valid message. grpc would answer UNKNOWN for a deserializer
    that raises (and end a stream with it); the handlers refuse it as INVALID_ARGUMENT instead,
    and a stream answers it with error_message and goes on."""

    error: str


def parser(message_type: type[_Req]) -> Callable[[bytes], _Req | Undecodable]:
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


def with_status(
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


def stream_with_status(
    method: Callable[[AsyncIterator[_Req]], AsyncIterator[_Resp]],
) -> Callable[[AsyncIterator[_Req], grpc.aio.ServicerContext], AsyncIterator[_Resp]]:
    """The streaming counterpart of `with_status`, for errors of the stream itself."""

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
