"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (JSON and SSE).
LoRA adapters' names and their load/unload routes: adapters.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import suppress
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response
from starlette.types import Receive

from inferd.gateway.contract import openai_errors, sse_or_json
from inferd.gateway.images import image_model_cards
from inferd.gateway.openai.adapters import adapter_cards
from inferd.gateway.openai.contract import ChatCompletionResponse, CompletionResponse, ModelCards
from inferd.gateway.openai.formatting import Json, Kind
from inferd.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from inferd.gateway.openai.serving import (
    Body,
    Job,
    OutputStream,
    collect,
    encode_response,
    finalize,
    prepare,
    start,
    stream_chunks,
    token_decoder,
)
from inferd.gateway.responses import (
    FinalizingResponse,
    FinalizingStreamingResponse,
    json_response,
    run_once,
)
from inferd.gateway.state import GatewayState, gateway
from inferd.telemetry.stages import Stage

router = APIRouter()
T = TypeVar("T")
# nginx's "client closed request": logged when the client left before the response was sent.
CLIENT_CLOSED = 499


# Every status a generation request can end with (validation, unknown model, body size, queue
# full, queue timeout/draining/engine dead, output backlog).
_GENERATE_ERRORS = openai_errors(400, 404, 413, 429, 503, 500)


@router.get("/v1/models", response_model=ModelCards, responses=openai_errors(503))
async def list_models(request: Request) -> Response:
    """The LLM (when the server runs one), its LoRA adapters, the image models and their styles,
    and the repository's embedding models."""
    state = gateway(request)
    data = []
    if state.serves_llm:
        llm = state.engine()
        data.append(
            {
                "id": state.model_name,
                "object": "model",
                "created": int(state.started),
                "owned_by": "inferd",
                "root": getattr(llm.info, "model_path", state.model_name),
                "max_model_len": llm.info.max_model_len,
            }
        )
        data.extend(adapter_cards(state))
    data.extend(image_model_cards(state))
    if state.repository is not None:
        for name in state.repository.embedding_models():
            data.append(
                {"id": name, "object": "model", "created": int(state.started), "owned_by": "inferd"}
            )
    return json_response({"object": "list", "data": data})


@router.post(
    "/v1/completions",
    response_model=None,
    responses={**sse_or_json(CompletionResponse), **_GENERATE_ERRORS},
)
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await serve_http(request, body, "completion")


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses={**sse_or_json(ChatCompletionResponse), **_GENERATE_ERRORS},
)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await serve_http(request, body, "chat")


class ClientGone(Exception):
    """The HTTP client disconnected before its response started."""


async def race_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Runs `work` until it ends or the client disconnects (then `work` is cancelled, which
    closes its engine streams and so aborts the request in the engine)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        for t in (watcher, task):
            if not t.done():
                t.cancel()
                with suppress(asyncio.CancelledError, Exception):
                    await t


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def serve_http(request: Request, body: Body, kind: Kind) -> Response:
    state = gateway(request)
    st = request.state
    job = await prepare(state, body, kind, st.request_id, st.arrival)
    # A router's span (or the client's): this request's trace joins it (telemetry/tracing.py).
    job.timeline.traceparent = request.headers.get("traceparent")
    decode = token_decoder(state.engine().tokenizer)
    try:
        outputs = await race_disconnect(request, start(state, job))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    state.inflight += 1
    done = _on_done(state, job, request, outputs)
    if body.stream:
        return FinalizingStreamingResponse(
            _sse(stream_chunks(job, decode, outputs)), done, media_type="text/event-stream"
        )
    try:
        result = await race_disconnect(request, collect(job, decode, outputs))
    except ClientGone:
        await done()
        return Response(status_code=CLIENT_CLOSED)
    except BaseException:
        await done()
        raise
    return FinalizingResponse(encode_response(job, result), done, media_type="application/json")


def _on_done(
    state: GatewayState, job: Job, request: Request, outputs: OutputStream
) -> Callable[[], Awaitable[None]]:
    async def done() -> None:
        state.inflight -= 1
        await outputs.aclose()
        if job.send_started is not None:
            job.timeline.add(Stage.STREAM, time.monotonic() - job.send_started)
        finalize(state, job)
        request.state.access_extra = {
            "prompt_tokens": job.prompt_tokens,
            "completion_tokens": job.completion_tokens,
            "finish_reasons": job.finish_reasons(),
            "timings": job.timeline.as_dict(),
        }

    return run_once(done)


async def _sse(chunks: AsyncIterator[Json]) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        yield b"data: " + orjson.dumps(chunk) + b"\n\n"
    yield b"data: [DONE]\n\n"
