"""The real server through the official `openai` client, httpx and a WebSocket client."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from typing import Any

import httpx
import openai
import pytest
import websockets
from conftest import Server
from openai.types.chat import ChatCompletionMessageParam

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(server: Server, model_name: str) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == [model_name]


def test_completion_usage_and_timings(server: Server, model_name: str) -> None:
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": model_name, "prompt": "Hello there", "max_tokens": 5, "temperature": 0},
        headers={"X-Request-Id": "my-req-1"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "my-req-1"
    body = r.json()
    tokens = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "Hello there", "max_tokens": 5, "temperature": 0, "logprobs": 0},
        timeout=60,
    ).json()
    n_out = len(tokens["choices"][0]["logprobs"]["tokens"])
    assert body["usage"]["completion_tokens"] == n_out
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + n_out
    assert body["choices"][0]["text"] == tokens["choices"][0]["text"]
    stages = ("receive", "validate", "tokenize", "queue", "prefill", "stream", "ttft", "e2e")
    for stage in stages:
        assert stage in body["timings"]
    assert list(body)[-1] == "timings"


def test_sync_client_chat_stream_matches_non_stream(server: Server, model_name: str) -> None:
    c = client(server)
    msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say something"}]
    full = c.chat.completions.create(model=model_name, messages=msgs, max_tokens=8, temperature=0)
    stream = c.chat.completions.create(
        model=model_name,
        messages=msgs,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == full.choices[0].message.content
    assert usage is not None and full.usage is not None
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_async_client_n_and_logprobs(server: Server, model_name: str) -> None:
    async def run() -> None:
        c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        r = await c.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            n=2,
            seed=1,
            logprobs=True,
            top_logprobs=2,
        )
        assert sorted(ch.index for ch in r.choices) == [0, 1]
        for ch in r.choices:
            assert ch.logprobs is not None and ch.logprobs.content
            assert all(len(t.top_logprobs) == 2 for t in ch.logprobs.content)
        # (every choice has logprobs.content: asserted just above)
        got = sum(len(ch.logprobs.content or []) for ch in r.choices if ch.logprobs)
        assert r.usage is not None and r.usage.completion_tokens == got
        s = await c.completions.create(model=model_name, prompt="Once", max_tokens=4, stream=True)
        finishes = [ch.choices[0].finish_reason async for ch in s if ch.choices]
        assert finishes[-1] in ("stop", "length")
        await c.close()

    asyncio.run(run())


# Bad bodies and the error the protocol fixes for each: (status, code, param, words of the message).
BAD: list[tuple[bytes, tuple[int, str, str | None, str]]] = [
    (b"{not json", (400, "invalid_json", None, "malformed JSON")),
    (b'{"prompt": "x", "max_tokens": "many"}', (400, "invalid_value", "max_tokens", "integer")),
    (b'{"prompt": "x", "max_tokens": -3}', (400, "invalid_value", "max_tokens", "greater than")),
    (
        b'{"prompt": "x", "max_tokens": 100000000}',
        (400, "context_length_exceeded", "max_tokens", "exceeds the context window"),
    ),
    (b'{"prompt": "x", "temperature": NaN}', (400, "invalid_value", "temperature", "finite")),
    (b'{"prompt": "\xff\xfe bad utf8"}', (400, "invalid_request", None, "parsing the body")),
    (
        b'{"prompt": "x", "model": "no-such-model"}',
        (404, "model_not_found", "model", "'no-such-model' does not exist"),
    ),
    (
        b'{"prompt": "' + b"word " * 400 + b'"}',
        (400, "context_length_exceeded", "prompt", "context window is 256 tokens"),
    ),
    (b'{"prompt": [99999999]}', (400, "invalid_value", "prompt", "[0, 4096)")),
    (b"[1, 2, 3]", (400, "invalid_value", None, "object")),
    (b'{"prompt": "x", "n": 0}', (400, "invalid_value", "n", "greater than or equal to 1")),
]
CHAT_BAD: list[tuple[object, str, str]] = [
    ([], "messages", "at least 1 item"),
    ("hi", "messages", "valid list"),
    ([{"role": "x"}], "messages.0.role", "'system', 'user', 'assistant', 'developer' or 'tool'"),
]


@pytest.mark.parametrize(("body", "expected"), BAD, ids=[b[:24].decode("latin-1") for b, _ in BAD])
def test_a_bad_completion_body_gets_the_protocols_error(
    server: Server, body: bytes, expected: tuple[int, str, str | None, str]
) -> None:
    status, code, param, words = expected
    headers = {"content-type": "application/json"}
    r = httpx.post(f"{server.url}/v1/completions", content=body, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    assert (err["type"], err["code"], err["param"]) == (kind, code, param)
    assert words in err["message"]


@pytest.mark.parametrize(("messages", "param", "words"), CHAT_BAD)
def test_bad_chat_messages_get_a_400_naming_the_field(
    server: Server, messages: object, param: str, words: str
) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == (
        "invalid_request_error",
        "invalid_value",
        param,
    )
    assert words in err["message"]


def test_after_a_storm_of_bad_input_good_requests_still_work(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as h:
        for body, _ in BAD:
            h.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        r = h.post("/v1/completions", content=b"x" * 70000)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = h.get("/v1/nope")
        assert r.status_code == 404
        assert r.json()["error"] == {
            "message": "Not Found",
            "type": "not_found_error",
            "param": None,
            "code": "not_found",
        }
        r = h.post("/v1/completions", json={"prompt": "still fine", "max_tokens": 2})
        assert r.status_code == 200
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_health_and_openapi(server: Server) -> None:
    # The body says what the status says, in each protocol's words.
    expected = {
        "/health/live": {"status": "live"},
        "/health/ready": {"status": "ready"},
        "/v2/health/live": {"live": True},
        "/v2/health/ready": {"ready": True},
    }
    for path, body in expected.items():
        r = httpx.get(server.url + path, timeout=10)
        assert (r.status_code, r.json()) == (200, body), path
    doc = httpx.get(server.url + "/openapi.json", timeout=10).json()
    assert "/v1/chat/completions" in doc["paths"]


def test_websocket_stream_and_cancel(server: Server) -> None:
    url = server.url.replace("http", "ws") + "/v1/completions/ws"

    async def run() -> None:
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"prompt": "Hello", "max_tokens": 4, "temperature": 0}))
            chunks = []
            while (msg := await ws.recv()) != "[DONE]":
                chunks.append(json.loads(msg))
            assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
            assert "timings" in chunks[-1]
            body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True}
            await ws.send(json.dumps(body))
            await ws.recv()
            await ws.send(json.dumps({"type": "cancel"}))
            n = 0
            while await ws.recv() != "[DONE]":
                n += 1
            assert n < 200

    asyncio.run(run())


def test_disconnect_frees_blocks(server: Server) -> None:
    body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        for _ in r.iter_lines():
            break
    # The engine frees within one step; allow a few for the reader and scheduler.
    for _ in range(50):
        m = server.metrics()
        if m["inferd_num_requests_running"] == 0 and m["inferd_kv_cache_usage_ratio"] == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert m["inferd_num_requests_running"] == 0
    assert m["inferd_kv_cache_usage_ratio"] == 0
    assert m['inferd_requests_finished_total{lora="",reason="abort"}'] >= 1


def test_metrics_names_and_promtool(server: Server) -> None:
    httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=30)
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for name in (
        "inferd_request_receive_seconds_bucket",
        "inferd_request_queue_seconds_bucket",
        "inferd_request_prefill_seconds_bucket",
        "inferd_request_decode_seconds_bucket",
        "inferd_request_detokenize_seconds_bucket",
        "inferd_request_stream_seconds_bucket",
        "inferd_time_to_first_token_seconds_bucket",
        "inferd_e2e_request_latency_seconds_bucket",
        "inferd_prompt_tokens_total",
        "inferd_generation_tokens_total",
        "inferd_preemptions_total",
        "inferd_kv_cache_usage_ratio",
        "inferd_step_token_budget",
    ):
        assert name in text, name
    # The tiny model's steps are far under the step-time target: the whole budget.
    assert server.metrics()["inferd_step_token_budget"] == 2048
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert res.returncode == 0 and not res.stdout.strip(), res.stdout + res.stderr


def test_the_access_log_has_one_json_line_per_request(server: Server) -> None:
    # On by default: the line is the `inferd.access` logger's message, in the server's output.
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "Hello there", "max_tokens": 3, "ignore_eos": True},
        headers={"X-Request-Id": "access-log-1"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30  # written as the response ends: maybe just after we read it
    while not (lines := _access_lines(server, "access-log-1")):
        assert time.monotonic() < deadline, "no access-log line for the request"
        time.sleep(0.05)
    (entry,) = lines
    assert (entry["method"], entry["path"], entry["status"]) == ("POST", "/v1/completions", 200)
    assert entry["bytes_out"] == len(r.content)
    assert entry["client"].startswith("127.0.0.1:")
    usage = r.json()["usage"]
    assert entry["prompt_tokens"] == usage["prompt_tokens"]
    assert entry["completion_tokens"] == usage["completion_tokens"] == 3
    assert 0 < entry["duration_ms"] < 60_000


def _access_lines(server: Server, request_id: str) -> list[dict[str, Any]]:
    out = []
    for line in server.log.read_text(errors="replace").splitlines():
        _, marker, payload = line.partition("inferd.access: ")
        if marker and f'"request_id":"{request_id}"' in payload:
            out.append(json.loads(payload))
    return out
