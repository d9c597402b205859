"""WebSocket streaming: /v1/completions/ws and /v1/chat/completions/ws (and, on the same
connection loop, /v1/images/generations/ws: image_websocket.py).

Protocol (text frames, one JSON value each):
  client -> server: a request body, exactly as for the HTTP endpoint (`stream` is implied), or
                    {"type": "cancel"} to stop the request being streamed.
  server -> client: the same chunk objects as the SSE stream, then the text `[DONE]`; an error is
                    OpenAI's error object {"error": {...}} (plus "status", the HTTP status it
                    would have had), then `[DONE]`.
One request at a time per connection; after `[DONE]` the client may send the next. Closing the
connection, or a cancel, aborts the request in the engine within one step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from contextlib import suppress
from functools import partial
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import BaseModel, ValidationError

from inferd.errors import InferdError
from inferd.gateway.errors import APIError, bad_request, to_api_error
from inferd.gateway.openai.formatting import Kind
from inferd.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from inferd.gateway.openai.serving import (
    Body,
    finalize,
    prepare,
    start,
    stream_chunks,
    token_decoder,
)
from inferd.gateway.state import GatewayState, gateway

router = APIRouter()
M = TypeVar("M", bound=BaseModel)
DONE = "[DONE]"
_CLOSED = None  # put on the inbox when the client goes away


Inbox = asyncio.Queue[tuple[float, Any] | None]
# Serves one request message on a connection: (ws, state, inbox, message, arrival, request_id)
# -> True when the client closed the connection meanwhile.
OneRequest = Callable[[WebSocket, GatewayState, Inbox, Any, float, str], Coroutine[Any, Any, bool]]


@router.websocket("/v1/completions/ws")
async def completions_ws(ws: WebSocket) -> None:
    await serve_ws(ws, partial(_one_request, kind="completion"))


@router.websocket("/v1/chat/completions/ws")
async def chat_completions_ws(ws: WebSocket) -> None:
    await serve_ws(ws, partial(_one_request, kind="chat"))


async def serve_ws(ws: WebSocket, one_request: OneRequest) -> None:
    """The connection's loop: each request message in turn (image_websocket.py serves the image
    lane's with its own `one_request`)."""
    await ws.accept()
    state = gateway(ws)
    inbox: Inbox = asyncio.Queue()
    reader = asyncio.create_task(_read(ws, inbox))
    base_id = ws.scope["state"]["request_id"]
    try:
        for seq in range(1 << 62):
            item = await inbox.get()
            if item is _CLOSED:
                return
            arrival, message = item
            if isinstance(message, dict) and message.get("type") == "cancel":
                continue  # nothing running: a late cancel
            closed = await one_request(ws, state, inbox, message, arrival, f"{base_id}-{seq}")
            if closed:
                return
    finally:
        reader.cancel()
        with suppress(asyncio.CancelledError):
            await reader


async def _read(ws: WebSocket, inbox: Inbox) -> None:
    try:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                break
            arrival = time.monotonic()
            data = message.get("text") or message.get("bytes") or b""
            try:
                inbox.put_nowait((arrival, orjson.loads(data)))
            except orjson.JSONDecodeError as e:
                err = bad_request(f"malformed JSON: {e}", None, "invalid_json")
                inbox.put_nowait((arrival, err))
    except (WebSocketDisconnect, RuntimeError):
        pass
    finally:
        inbox.put_nowait(_CLOSED)


async def send_error(ws: WebSocket, state: GatewayState, err: APIError) -> None:
    if err.status != 500:
        state.metrics.reject(err.reason)
    await ws.send_text(orjson.dumps({**err.body(), "status": err.status}).decode())
    await ws.send_text(DONE)


def parse_message(model: type[M], message: Any) -> M:
    """A request message as `model` (a body whose `stream` is implied); 400 when it is not."""
    if isinstance(message, APIError):
        raise message
    if not isinstance(message, dict):
        raise bad_request("a request must be a JSON object")
    try:
        return model.model_validate({**message, "stream": True})
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        raise bad_request(f"{param}: {first.get('msg')}" if param else str(e), param) from None


async def _one_request(
    ws: WebSocket,
    state: GatewayState,
    inbox: Inbox,
    message: Any,
    arrival: float,
    request_id: str,
    *,
    kind: Kind,
) -> bool:
    """Serves one request; True when the client closed the connection meanwhile."""
    try:
        model: type[Body] = ChatCompletionRequest if kind == "chat" else CompletionRequest
        body = parse_message(model, message)
        job = await prepare(state, body, kind, request_id, arrival)
        decode = token_decoder(state.engine().tokenizer)
        outputs = await start(state, job)
    except (APIError, InferdError) as e:
        await send_error(ws, state, to_api_error(e))
        return False
    state.inflight += 1
    producer = asyncio.create_task(_produce(ws, stream_chunks(job, decode, outputs)))
    try:
        return await until_done_or_cancel(ws, producer, inbox)
    finally:
        state.inflight -= 1
        with suppress(Exception):
            await outputs.aclose()
        finalize(state, job)
        _add_usage(ws, job.prompt_tokens, job.completion_tokens)


def _add_usage(ws: WebSocket, prompt_tokens: int, completion_tokens: int) -> None:
    """The connection's token totals, which the middleware charges to its API key."""
    extra = ws.scope["state"].setdefault("access_extra", {})
    extra["prompt_tokens"] = extra.get("prompt_tokens", 0) + prompt_tokens
    extra["completion_tokens"] = extra.get("completion_tokens", 0) + completion_tokens


async def _produce(ws: WebSocket, chunks: Any) -> None:
    async for chunk in chunks:
        await ws.send_text(orjson.dumps(chunk).decode())
    await ws.send_text(DONE)


async def until_done_or_cancel(ws: WebSocket, producer: asyncio.Task[None], inbox: Inbox) -> bool:
    """Waits for the stream to end; a cancel or a close stops it (True: the socket is gone).
    Requests that arrive meanwhile wait in the inbox for their turn."""
    held: list[tuple[float, Any]] = []
    outcome = "done"
    try:
        while not producer.done():
            getter = asyncio.ensure_future(inbox.get())
            await asyncio.wait({producer, getter}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                break
            item = getter.result()
            if item is _CLOSED:
                outcome = "closed"
                break
            if isinstance(item[1], dict) and item[1].get("type") == "cancel":
                outcome = "cancel"
                break
            held.append(item)
    finally:
        for kept in held:
            inbox.put_nowait(kept)
    return await _settle(ws, producer, outcome)


async def _settle(ws: WebSocket, producer: asyncio.Task[None], outcome: str) -> bool:
    if outcome == "done":
        try:
            producer.result()
        except (WebSocketDisconnect, RuntimeError, OSError):
            return True
        return False
    producer.cancel()  # closes the chunk stream, which aborts the request in the engine
    with suppress(asyncio.CancelledError, Exception):
        await producer
    if outcome == "closed":
        return True
    try:
        await ws.send_text(DONE)
    except (WebSocketDisconnect, RuntimeError, OSError):
        return True
    return False
