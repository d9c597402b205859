"""The replicas' own cached-token counts (usage.prompt_tokens_details.cached_tokens) reach the
router's prefix index through the proxy, in plain and streamed answers (with include_usage), and
are counted in inferd_router_index_stale_blocks_total."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI
from prometheus_client import generate_latest

from inferd.preprocess.tokenizer import Tokenizer
from inferd.router.app import create_router_app
from inferd.router.config import RouterConfig
from inferd.router.tokenize import load_tokenizer

A = "http://a"
OLD, SESSION, NEWER = ([base + i for i in range(64)] for base in (1000, 100, 2000))


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("inferd-tiny", None, None)


class _Events(httpx.AsyncByteStream):
    def __init__(self, usage: dict[str, Any]) -> None:
        self.usage = usage

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b'data: {"choices": [{"text": "a"}]}\n\n'
        yield b"data: " + orjson.dumps({"choices": [], "usage": self.usage}) + b"\n\n"
        yield b"data: [DONE]\n\n"


def _replica(cached: dict[int, int]) -> httpx.MockTransport:
    """Answers with the usage a replica would give: `cached[first token]` cached tokens."""

    async def handler(req: httpx.Request) -> httpx.Response:
        body = orjson.loads(req.content)
        prompt = body["prompt"]
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": 1,
            "total_tokens": len(prompt) + 1,
            "prompt_tokens_details": {"cached_tokens": cached.get(prompt[0], 0)},
        }
        if body.get("stream"):
            headers = {"content-type": "text/event-stream"}
            return httpx.Response(200, headers=headers, stream=_Events(usage))
        return httpx.Response(200, json={"choices": [{"text": "a"}], "usage": usage})

    return httpx.MockTransport(handler)


def _post_all(app: FastAPI, prompts: list[list[int]], stream: bool) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            bodies = [{"prompt": p, "max_tokens": 1, "stream": stream} for p in prompts]
            return [await c.post("/v1/completions", json=b) for b in bodies]

    return asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True])
def test_a_replica_reporting_an_evicted_prefix_corrects_the_index(
    tok: Tokenizer, stream: bool
) -> None:
    # The session comes back after two other prompts; the replica says it kept only its first
    # block, so it evicted the rest and the older prompt (OLD) with it.
    app = create_router_app(RouterConfig(replicas=(A,)), tok, _replica({SESSION[0]: 16}))
    router = app.state.router
    router.cluster.set_health(A, ready=True)
    answers = _post_all(app, [OLD, SESSION, NEWER, SESSION], stream)
    assert [r.status_code for r in answers] == [200] * 4
    assert answers[-1].headers["x-inferd-route-cached-tokens"] == "64"  # what the index claimed
    index = router.cluster.index
    assert index.size(A) == 8  # OLD's 4 blocks dropped; SESSION (re-computed) and NEWER stay
    assert router.cluster.route(OLD).decision.cached_tokens == 0
    assert router.cluster.route(NEWER).decision.cached_tokens == 64
    page = generate_latest(router.metrics.registry).decode()
    assert f'inferd_router_index_stale_blocks_total{{replica="{A}"}} 4.0' in page
    if stream:
        assert answers[-1].text.endswith("data: [DONE]\n\n")
