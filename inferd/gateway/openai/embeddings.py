"""OpenAI's POST /v1/embeddings, served by the repository's embedding models.

    {"model": "minilm", "input": ["a", "b"], "encoding_format": "base64", "dimensions": 128}
    -> {"object": "list", "model": "minilm",
        "data": [{"object": "embedding", "index": 0, "embedding": "<base64 of float32 LE>"}, ...],
        "usage": {"prompt_tokens": 9, "total_tokens": 9}, "timings": {"receive": ..., ...}}

An embedding model is one whose config.yaml has an `embedding:` section: its BYTES input
(`embedding.input`) takes the texts as [n, 1], its output (`embedding.output`) holds [n, D]. The
texts go through the model's own pipeline (tokenize, batcher, backend, pooling), split into
requests of at most max_batch_size rows that run concurrently, so a long input list still
batches with other clients' requests. `dimensions` truncates to one of the sizes the config
allows and L2-renormalizes (Matryoshka style). Token-id inputs are refused: the model's
tokenizer is a preprocess step that takes text.
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
import orjson
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema
from starlette.responses import Response

from inferd.errors import ModelNotFoundError
from inferd.gateway.contract import openai_errors
from inferd.gateway.errors import APIError, bad_request, model_not_found
from inferd.gateway.openai.contract import EmbeddingResponse
from inferd.gateway.openai.protocol import JsonInt
from inferd.gateway.responses import FinalizingResponse
from inferd.gateway.state import GatewayState, gateway
from inferd.model_config import EmbeddingConfig
from inferd.telemetry.stages import Stage, StageTimings
from inferd.tensors import InferRequest, InferResponse

if TYPE_CHECKING:
    from inferd.batching.pipeline import ServedModel

router = APIRouter(tags=["openai"])


class EmbeddingRequest(BaseModel):
    # Unknown fields are ignored, as OpenAI's and vLLM's servers do.
    model_config = ConfigDict(extra="ignore")

    model: str
    # Checked in `parse_input`, for a message that names the problem (token ids).
    input: Annotated[
        Any,
        WithJsonSchema(
            {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "string"}, "minItems": 1},
                ],
                "description": "A string or a non-empty list of strings",
            }
        ),
    ]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: JsonInt | None = Field(default=None, ge=1)
    user: str | None = None


@dataclass(frozen=True)
class EmbeddingModel:
    served: ServedModel
    spec: EmbeddingConfig  # served.config.embedding, known to be set

    @property
    def full_dimensions(self) -> int | None:
        """D from the config's output dims when they give it (else known after inference)."""
        for t in self.served.config.output:
            if t.name == self.spec.output and t.dims and t.dims[-1] > 0:
                return int(t.dims[-1])
        return None

    def requests(self, texts: list[str], arrival: float) -> list[InferRequest]:
        """At most max_batch_size texts per request, one text per row: [n, 1] for the usual
        `dims: [1]` (no batch dim, one text each, when max_batch_size is 0)."""
        cfg = self.served.config
        rows = cfg.max_batch_size if cfg.max_batch_size > 0 else 1
        dims = next((t.dims for t in cfg.input if t.name == self.spec.input), (1,))
        row_shape = (1,) * len(dims)
        out = []
        for i in range(0, len(texts), rows):
            chunk = texts[i : i + rows]
            array = np.empty(len(chunk), dtype=object)
            array[:] = [t.encode() for t in chunk]
            shape = (len(chunk), *row_shape) if cfg.max_batch_size > 0 else row_shape
            out.append(self._request(array.reshape(shape), arrival))
        return out

    def _request(self, text: np.ndarray, arrival: float) -> InferRequest:
        return InferRequest(
            model_name=self.served.name,
            model_version=self.served.version,
            inputs={self.spec.input: text},
            arrival=arrival,
        )


@router.post(
    "/v1/embeddings",
    response_model=EmbeddingResponse,
    responses=openai_errors(400, 404, 413, 429, 503, 500),
)
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    state = gateway(request)
    state.admitting()
    texts = parse_input(body.input)
    model = embedding_model(state, body.model)
    if body.dimensions is not None:
        check_dimensions(body.dimensions, model.spec.dimensions, model.full_dimensions)
    arrival = float(getattr(request.state, "arrival", time.monotonic()))
    receive_s = time.monotonic() - arrival
    state.inflight += 1
    try:
        # Concurrent, so the chunks batch with each other and with other clients' requests.
        requests = model.requests(texts, arrival)
        responses = list(await asyncio.gather(*(model.served.infer(r) for r in requests)))
        stream_start = time.monotonic()
        vectors = _vectors(responses, model.spec.output, len(texts))
        if body.dimensions is not None:
            check_dimensions(body.dimensions, model.spec.dimensions, vectors.shape[1])
            vectors = truncate(vectors, body.dimensions)
        timings = merge_timings(responses)
        timings.set(Stage.RECEIVE, receive_s)
        name = model.served.name
        result = _body(body, name, vectors, responses, timings, stream_start)
        return _respond(request, state, name, result, timings, stream_start)
    except BaseException:
        state.inflight -= 1
        raise


def parse_input(value: Any) -> list[str]:
    """`input`: a string or a non-empty list of strings."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    if isinstance(value, list) and value and all(isinstance(v, int | list) for v in value):
        raise bad_request(
            "token-id input is not supported: send the text (a string or a list of strings)",
            "input",
        )
    raise bad_request("input must be a string or a non-empty list of strings", "input")


def embedding_model(state: GatewayState, name: str) -> EmbeddingModel:
    """The ready embedding model called `name`, or OpenAI's 404."""
    repo = state.repository
    if repo is None or name not in repo.embedding_models():
        raise model_not_found(name)
    try:
        served = repo.get(name)
    except ModelNotFoundError:
        raise model_not_found(name) from None
    spec = served.config.embedding
    if spec is None:  # reloaded without its embedding section since the check above
        raise model_not_found(name)
    return EmbeddingModel(served, spec)


def check_dimensions(dimensions: int, allowed: tuple[int, ...], full: int | None) -> None:
    if dimensions == full or (dimensions in allowed and (full is None or dimensions <= full)):
        return
    sizes = sorted({*allowed, *([full] if full is not None else [])})
    raise bad_request(
        f"dimensions={dimensions} is not supported by this model; supported: {sizes}",
        "dimensions",
    )


def truncate(vectors: np.ndarray, dimensions: int) -> np.ndarray:
    """The first `dimensions` components, L2-renormalized (a zero vector stays zero)."""
    cut = vectors[:, :dimensions]
    norms = np.linalg.norm(cut, axis=1, keepdims=True)
    return np.divide(cut, norms, out=np.zeros_like(cut), where=norms > 0)


def _vectors(responses: list[InferResponse], output: str, n: int) -> np.ndarray:
    parts = []
    for r in responses:
        found = next((o for o in r.outputs if o.name == output), None)
        if found is None:
            raise APIError(
                500,
                f"model {r.model_name!r} returned no output {output!r} (embedding.output)",
                type="server_error",
                code="internal_error",
            )
        parts.append(np.asarray(found.data, dtype=np.float32).reshape(len(found.data), -1))
    vectors = np.concatenate(parts)
    assert vectors.shape[0] == n, (vectors.shape, n)
    return vectors


def merge_timings(responses: list[InferResponse]) -> StageTimings:
    """The chunks ran concurrently, so each stage took as long as its slowest chunk."""
    out = StageTimings()
    for r in responses:
        for stage, seconds in r.timings.seconds.items():
            out.set(stage, max(out.seconds.get(stage, 0.0), seconds))
    return out


def _body(
    body: EmbeddingRequest,
    model: str,
    vectors: np.ndarray,
    responses: list[InferResponse],
    timings: StageTimings,
    stream_start: float,
) -> bytes:
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
        for i, v in enumerate(vectors)
    ]
    tokens = sum(r.num_input_tokens or 0 for r in responses)
    timings.set(Stage.STREAM, time.monotonic() - stream_start)
    doc = {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "timings": timings.as_dict(),
    }
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)


def _encode(vector: np.ndarray, encoding_format: str) -> Any:
    if encoding_format == "base64":
        # OpenAI's format: base64 of the little-endian float32 bytes.
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return np.ascontiguousarray(vector, dtype=np.float32)


def _respond(
    request: Request,
    state: GatewayState,
    model: str,
    content: bytes,
    timings: StageTimings,
    stream_start: float,
) -> Response:
    async def done() -> None:
        state.inflight -= 1
        stream_s = time.monotonic() - stream_start
        state.model_metrics.observe_gateway(model, timings.seconds[Stage.RECEIVE], stream_s)
        extra_timings = {**timings.as_dict(digits=None), "stream": stream_s}
        request.state.access_extra = {"model": model, "timings": extra_timings}

    return FinalizingResponse(content, done, media_type="application/json")
