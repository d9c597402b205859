"""POST /v1/embeddings through the official `openai` client (and httpx) against a real uvicorn
serving a model repository with an embedding model (see kserve_server.py)."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from kserve_server import EMBED_DIM, LiveServer, embed_reference, serve, write_repository

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TEXTS = ["hello world", "the quick brown fox", "a", "ünïcode text here"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = write_repository(tmp_path_factory.mktemp("repo"))
    with serve(root) as live:
        yield live


def create(server: LiveServer, **kw: Any) -> Any:
    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        async with client:
            return await client.embeddings.create(**kw)

    return asyncio.run(run())


def words(texts: list[str]) -> int:
    return sum(len(t.split()) for t in texts)


@pytest.mark.parametrize("encoding_format", [None, "float", "base64"])
def test_embeddings_match_the_model(server: LiveServer, encoding_format: str | None) -> None:
    kw = {} if encoding_format is None else {"encoding_format": encoding_format}
    result = create(server, model="embedder", input=TEXTS, **kw)
    assert result.model == "embedder" and result.object == "list"
    assert [d.index for d in result.data] == list(range(len(TEXTS)))
    if encoding_format == "base64":
        # The client hands an explicit base64 request back undecoded.
        vectors = [np.frombuffer(base64.b64decode(str(d.embedding)), "<f4") for d in result.data]
    else:
        vectors = [np.asarray(d.embedding) for d in result.data]
    for text, got in zip(TEXTS, vectors, strict=True):
        np.testing.assert_allclose(got, embed_reference(text), atol=1e-6)
    assert result.usage.prompt_tokens == result.usage.total_tokens == words(TEXTS)


def test_single_string_input(server: LiveServer) -> None:
    result = create(server, model="embedder", input="just one")
    assert len(result.data) == 1 and len(result.data[0].embedding) == EMBED_DIM
    assert result.usage.prompt_tokens == 2


def test_more_texts_than_max_batch_size_keep_their_order(server: LiveServer) -> None:
    texts = [f"text number {i} " + "x" * i for i in range(11)]  # max_batch_size is 4
    result = create(server, model="embedder", input=texts, encoding_format="float")
    assert [d.index for d in result.data] == list(range(11))
    for text, d in zip(texts, result.data, strict=True):
        np.testing.assert_allclose(d.embedding, embed_reference(text), atol=1e-6)
    assert result.usage.prompt_tokens == words(texts)


@pytest.mark.parametrize("dimensions", [4, EMBED_DIM])
def test_dimensions_truncate_and_renormalize(server: LiveServer, dimensions: int) -> None:
    result = create(server, model="embedder", input=TEXTS, dimensions=dimensions)
    for text, d in zip(TEXTS, result.data, strict=True):
        cut = embed_reference(text)[:dimensions]
        np.testing.assert_allclose(d.embedding, cut / np.linalg.norm(cut), atol=1e-6)
        assert abs(np.linalg.norm(d.embedding) - 1.0) < 1e-5


@pytest.mark.parametrize("dimensions", [3, 5, 100])
def test_unsupported_dimensions_are_400(server: LiveServer, dimensions: int) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        create(server, model="embedder", input="a", dimensions=dimensions)
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == "dimensions"
    assert "[4, 8]" in error["message"]


@pytest.mark.parametrize("model", ["nope", "classifier"])
def test_unknown_or_non_embedding_model_is_404(server: LiveServer, model: str) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        create(server, model=model, input="a")
    assert model in str(info.value)


@pytest.mark.parametrize(
    ("value", "message"),
    [([1, 2, 3], "token-id"), ([[1, 2], [3]], "token-id"), ([], "non-empty"), (5, "string")],
)
def test_bad_input_is_400(server: LiveServer, value: Any, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        create(server, model="embedder", input=value)
    assert message in str(info.value)


def test_raw_response_has_timings_and_openai_errors(server: LiveServer) -> None:
    r = httpx.post(
        f"{server.url}/v1/embeddings",
        json={"model": "embedder", "input": ["hi there"], "encoding_format": "base64"},
    )
    assert r.status_code == 200
    body = r.json()
    for stage in ("receive", "queue", "infer", "stream"):
        assert body["timings"][stage] >= 0.0
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(vector, embed_reference("hi there"), atol=1e-6)
    bad = httpx.post(
        f"{server.url}/v1/embeddings",
        json={"model": "embedder", "input": "a", "encoding_format": "hex"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    missing = httpx.post(f"{server.url}/v1/embeddings", json={"input": "a"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"


def test_draining_is_503(server: LiveServer) -> None:
    server.state.draining = True
    try:
        with pytest.raises(openai.InternalServerError) as info:
            create(server, model="embedder", input="a")
        assert info.value.status_code == 503
    finally:
        server.state.draining = False
