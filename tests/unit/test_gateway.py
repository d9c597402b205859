"""The HTTP gateway in-process against a fake engine client: protocol shapes, errors, metrics."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from dataclasses import replace
from typing import Any

import pytest
from fake_llm import PROMPT_IDS, REPLY, FakeLLM
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from inferd.config import ServerConfig
from inferd.errors import QueueFullError, QueueTimeoutError
from inferd.gateway import create_app
from inferd.kv_cache.block_hash import block_hashes
from inferd.telemetry.timeline import RequestTimeline
from inferd.types import RequestMetrics


def make(llm: FakeLLM | None = None, **server: Any) -> tuple[TestClient, FakeLLM]:
    fake = llm or FakeLLM()
    app = create_app(fake, ServerConfig(access_log=False, **server))
    return TestClient(app, raise_server_exceptions=False), fake


def test_completion_body_usage_and_timings() -> None:
    c, _ = make()
    r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == REPLY[:5]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 5,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert body["timings"]["prefill"] == pytest.approx(0.5)
    assert body["timings"]["decode"] == pytest.approx(0.5)
    assert r.headers["x-request-id"]


def test_telemetry_off_records_nothing() -> None:
    c, _ = make(telemetry=False)
    body = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5}).json()
    assert "timings" not in body and body["usage"]["completion_tokens"] == 5
    r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True})
    assert all("timings" not in e for e in _events(r.text))
    text = c.get("/metrics").text
    assert "inferd_request_prefill_seconds_count 0.0" in text
    assert 'inferd_generation_tokens_total{lora=""} 0.0' in text


def test_batch_prompts_and_n_index_choices() -> None:
    c, _ = make()
    r = c.post("/v1/completions", json={"prompt": ["a", "bb"], "n": 2, "max_tokens": 3})
    body = r.json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == 3
    assert body["usage"]["completion_tokens"] == 12


def _events(text: str) -> list[Any]:
    data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_chat_stream_role_first_usage_last() -> None:
    c, fake = make()
    body = {
        "messages": [{"role": "user", "content": "hey"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "priority": 3,
        "timeout": 2.5,
    }
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"]["content"] for e in events if e["choices"])
    assert text == REPLY
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == len(REPLY)
    assert "timings" in events[-1]
    assert fake.seen[-1]["priority"] == 3 and fake.seen[-1]["timeout_s"] == 2.5


def test_logprob_shapes() -> None:
    c, _ = make()
    r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["h", "e"] and lp["token_logprobs"] == [-0.5, -0.5]
    assert lp["text_offset"] == [0, 1] and lp["top_logprobs"][0] == {"h": -0.5}
    chat = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2}
    r = c.post("/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in content] == ["h", "e"]
    assert [a["token"] for a in content[0]["top_logprobs"]] == ["h", "x"]


BAD_BODIES = [
    b"{oops",
    b'{"prompt": "x", "temperature": NaN}',
    b'{"prompt": "x", "max_tokens": "3"}',
    b'{"prompt": "x", "max_tokens": -1}',
    b'{"prompt": "x", "max_tokens": 1000}',
    b'{"prompt": "' + b"y" * 80 + b'"}',
    b'{"prompt": "\xff\xfe"}',
    b'{"prompt": ""}',
    b'{"prompt": [300]}',
    b'{"prompt": "x", "top_p": 0}',
    b"[]",
]


@pytest.mark.parametrize("body", BAD_BODIES)
def test_bad_input_is_400_with_openai_error(body: bytes) -> None:
    c, _ = make()
    r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_status_mapping() -> None:
    c, fake = make(api_keys=("k1",), max_body_bytes=100)
    auth = {"Authorization": "Bearer k1"}
    assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 401
    assert c.get("/health/ready").status_code == 200  # health needs no key
    r = c.post("/v1/completions", json={"prompt": "x", "model": "other"}, headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = c.post("/v1/completions", json={"prompt": "x" * 200}, headers=auth)
    assert r.status_code == 413
    assert c.get("/v1/nothing", headers=auth).status_code == 404
    fake.fail_with = QueueFullError("full", retry_after=2.2)
    r = c.post("/v1/completions", json={"prompt": "x"}, headers=auth)
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    fake.fail_with = QueueTimeoutError("late")
    r = c.post("/v1/completions", json={"prompt": "x", "stream": True}, headers=auth)
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout"


def test_not_ready_and_dead() -> None:
    c, _ = make(llm=None)
    c.app.state.gateway.llm = None  # type: ignore[attr-defined]
    assert c.get("/health/ready").status_code == 503
    assert c.get("/health/live").status_code == 200
    assert c.post("/v1/completions", json={"prompt": "x"}).json()["error"]["code"] == "not_ready"
    c2, fake = make()
    fake.dead = True
    assert c2.get("/v2/health/ready").status_code == 503


def test_websocket_stream_and_errors() -> None:
    c, _ = make()
    with c.websocket_connect("/v1/completions/ws") as ws:
        ws.send_text(json.dumps({"prompt": "hi", "max_tokens": 3}))
        msgs = []
        while (m := ws.receive_text()) != "[DONE]":
            msgs.append(json.loads(m))
        assert "".join(m["choices"][0]["text"] for m in msgs) == REPLY[:3]
        ws.send_text("{bad")
        err = json.loads(ws.receive_text())
        assert err["status"] == 400 and ws.receive_text() == "[DONE]"


def test_metrics_exposition() -> None:
    c, _ = make()
    c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    c.post("/v1/completions", json={"prompt": "hi", "max_tokens": -2})
    text = c.get("/metrics").text
    assert 'inferd_requests_rejected_total{reason="invalid"} 1.0' in text
    assert 'inferd_generation_tokens_total{lora=""} 2.0' in text
    assert 'inferd_requests_finished_total{lora="",reason="length"} 1.0' in text
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed")
    res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert res.returncode == 0 and not res.stdout.strip(), res.stdout + res.stderr


def test_timeline_stages_merge_over_engine_requests() -> None:
    tl = RequestTimeline("r", arrival=10.0)
    tl.mark_enqueued(10.1)
    a = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.3, first_token_time=10.4)
    b = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.2, first_token_time=10.5)
    tl.update_from_engine(a, "a")
    tl.update_from_engine(b, "b")
    tl.update_from_engine(replace(a, finished_time=11.0, detokenize_s=0.01), "a")
    tl.update_from_engine(replace(b, finished_time=11.5, detokenize_s=0.02), "b")
    tl.on_tokens(1, 10.4)
    tl.on_tokens(3, 10.7)
    tl.finish(12.0)
    d = tl.as_dict()
    assert math.isclose(d["queue"], 0.1) and math.isclose(d["prefill"], 0.2)
    assert math.isclose(d["decode"], 1.1) and math.isclose(d["detokenize"], 0.03)
    assert math.isclose(d["ttft"], 0.4) and math.isclose(d["e2e"], 2.0)
    assert [round(g, 6) for g in tl.token_gaps] == [0.1, 0.1, 0.1]


def test_per_key_token_limit_and_scopes_on_the_openai_routes(tmp_path: Any) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-a name=alice tpm=10 concurrency=4\n")
    c, _ = make(api_key_file=str(keys))
    auth = {"Authorization": "Bearer sk-a"}
    ws_path = "/v1/completions/ws"
    body = {"prompt": "hi", "max_tokens": 5}  # 2 prompt + 5 completion tokens
    first = c.post("/v1/completions", json=body, headers=auth)
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-tokens"] == "10"
    assert first.headers["x-ratelimit-remaining-tokens"] == "10"  # charged when it ends
    assert c.post("/v1/completions", json=body, headers=auth).status_code == 200
    r = c.post("/v1/completions", json=body, headers=auth)  # 14 of 10 spent: in debt
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert int(r.headers["retry-after"]) >= 1
    assert r.headers["x-ratelimit-remaining-tokens"] == "0"
    # The same key on the WebSocket: refused at the handshake.
    with pytest.raises(WebSocketDisconnect) as closed, c.websocket_connect(ws_path, headers=auth):
        pass
    assert closed.value.code == 1013  # try again later
    metrics = c.get("/metrics").text
    assert 'inferd_api_key_tokens_total{key="alice"} 14.0' in metrics
    assert 'inferd_api_key_requests_running{key="alice"} 0.0' in metrics


def test_kv_cache_blocks_is_the_engines_block_digest() -> None:
    c, _ = make()
    r = c.get("/v1/kv_cache/blocks")
    assert r.status_code == 200, r.text
    body = r.json()
    # The router's own hashes; blocks in use come latest indexed first, the prefix last.
    assert body["block_hashes"] == block_hashes(PROMPT_IDS, 4)[::-1]
    assert (body["block_size"], body["num_blocks"], body["num_cached"]) == (4, 8, 2)
    assert body["prefix_caching"] is True
    assert body["num_recent"] == 2  # the request still holds both blocks
    assert body["hash_version"] == "inferd-block-hash-v1"
    assert (
        c.get("/v1/kv_cache/blocks", params={"limit": 1}).json()["block_hashes"]
        == block_hashes(PROMPT_IDS, 4)[:1]  # a cut keeps the most recent: the prefix
    )


def test_kv_cache_blocks_bad_limit_is_400_and_loading_is_503() -> None:
    c, _ = make()
    for bad in ("0", "-3", "x", str(1 << 21)):
        r = c.get("/v1/kv_cache/blocks", params={"limit": bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == "limit" or "limit" in r.json()["error"]["message"]
    for bad in ("-1", "x", "1e9"):
        r = c.get("/v1/kv_cache/blocks", params={"recent_s": bad})
        assert r.status_code == 400, (bad, r.text)
    assert c.get("/v1/kv_cache/blocks", params={"recent_s": "4"}).json()["num_recent"] == 2
    loading = TestClient(create_app(None, ServerConfig(access_log=False)))
    r = loading.get("/v1/kv_cache/blocks")
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
