"""Overload, deadlines, priority, SIGTERM drain and engine death, each on its own server.

Where a test needs a request still running at some point, it pauses the engine core (SIGSTOP)
instead of hoping a generation is long enough: a fast machine cannot finish it early, a slow one
does not make the test wait longer."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import Server, start_server, stop_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

LONG = {"prompt": "Hello", "max_tokens": 120, "ignore_eos": True, "temperature": 0}


def _post_in_thread(
    url: str,
    body: dict[str, object],
    out: list[httpx.Response],
    headers: dict[str, str] | None = None,
) -> threading.Thread:
    def run() -> None:
        out.append(httpx.post(url, json=body, headers=headers, timeout=60))

    t = threading.Thread(target=run)
    t.start()
    return t


def _wait_metric(server: Server, name: str, at_least: float, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.metrics().get(name, 0) >= at_least:
            return
        time.sleep(0.05)
    raise AssertionError(f"{name} never reached {at_least}")


@contextmanager
def blocker(server: Server) -> Iterator[None]:
    """Holds the only running slot with a long stream until the block ends. The engine is paused
    for the block, so no machine is fast enough to finish the stream early and let the queue move;
    after it the stream is closed, which aborts it, so no test waits for a long generation."""
    release = threading.Event()
    body = {"prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}

    def run() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            for _ in r.iter_lines():
                if release.is_set():
                    break

    t = threading.Thread(target=run)
    t.start()
    try:
        _wait_metric(server, "inferd_num_requests_running", 1)
        with server.engine_paused():
            yield
    finally:
        release.set()  # the engine runs again: the reader sees its next line and closes
        t.join(60)


def _events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """The JSON payloads of an SSE stream, up to `[DONE]`."""
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line.removeprefix("data: "))


def _finish_reason(events: Iterator[dict[str, Any]]) -> str | None:
    reasons = [c["finish_reason"] for e in events for c in e.get("choices", [])]
    return next((r for r in reversed(reasons) if r is not None), None)


def _scheduled_at(server: Server, request_id: str) -> float:
    """When the engine first scheduled the request (unix seconds), from the server's request log:
    the end of its `queue` stage, which the engine's own first-scheduled instant closes."""
    doc = httpx.get(f"{server.url}/v1/requests/{request_id}", timeout=10).json()
    (queue,) = [s for s in doc["stages"] if s["stage"] == "queue"]
    return float(doc["arrival_unix"]) + float(queue["start"]) + float(queue["seconds"])


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # One running sequence, nothing extra waiting in the engine, two places in the queue.
    s = start_server(
        tmp_path_factory.mktemp("tight"),
        "--max-num-seqs", "1", "--max-queued-requests", "2", "--min-engine-waiting", "0",
        "--max-model-len", "2048", "--kv-cache-memory", "16MiB",
    )  # fmt: skip
    yield s
    stop_server(s)


def test_overload_gets_429_fast_and_nothing_hangs(tight: Server) -> None:
    url = f"{tight.url}/v1/completions"
    results: list[httpx.Response] = []
    threads = []
    with blocker(tight):
        for k in (1, 2):
            threads.append(_post_in_thread(url, {**LONG, "max_tokens": 2}, results))
            _wait_metric(tight, "inferd_num_requests_queued", k)
        r = httpx.post(url, json=LONG, timeout=10)
        # At once, not after the queued requests: the paused engine holds them until the block
        # ends, and they are still queued now.
        assert tight.metrics()["inferd_num_requests_queued"] == 2
        assert all(t.is_alive() for t in threads) and not results
    assert r.status_code == 429, r.text
    assert int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "queue_full"
    for t in threads:
        t.join(60)
    assert [x.status_code for x in results] == [200, 200]


def test_queue_deadline_gets_503(tight: Server) -> None:
    with blocker(tight):
        r = httpx.post(f"{tight.url}/v1/completions", json={**LONG, "timeout": 0.2}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout", r.text


def test_generation_deadline_finishes_with_timeout(tight: Server) -> None:
    # The deadline passes while the engine, paused after the first token, holds the request:
    # however fast the machine, the generation outlasts it.
    body = {**LONG, "max_tokens": 2000, "timeout": 0.5, "stream": True}
    with httpx.stream("POST", f"{tight.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(_events(lines))
        with tight.engine_paused():
            time.sleep(0.5)  # no wait for an event: the request's deadline must be behind us
        reason = _finish_reason(_events(lines))
    assert first["choices"][0]["finish_reason"] is None
    assert reason == "timeout"


def test_priority_serves_lower_value_first(tight: Server) -> None:
    url = f"{tight.url}/v1/completions"
    results: list[httpx.Response] = []
    tag = uuid.uuid4().hex[:8]
    body = {**LONG, "max_tokens": 2}
    # Both wait in the admission queue behind the running request; the later, more urgent one
    # (lower value) must be released to the engine first.
    with blocker(tight):
        low = _post_in_thread(url, {**body, "priority": 5}, results, {"X-Request-Id": f"lo-{tag}"})
        _wait_metric(tight, "inferd_num_requests_queued", 1)
        high = _post_in_thread(url, {**body, "priority": 0}, results, {"X-Request-Id": f"hi-{tag}"})
        _wait_metric(tight, "inferd_num_requests_queued", 2)
    for t in (low, high):
        t.join(60)
    assert [r.status_code for r in results] == [200, 200]
    # The order the engine took them in, as the server recorded it (not the order in which two
    # client threads happened to return).
    assert _scheduled_at(tight, f"hi-{tag}") < _scheduled_at(tight, f"lo-{tag}")


def test_sigterm_drains_in_flight_then_exits_zero(tmp_path: Path) -> None:
    s = start_server(tmp_path)
    try:
        body = {**LONG, "max_tokens": 240, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(_events(lines))
            # Paused, the request is in flight however fast the machine: it outlives the signal,
            # the readiness poll and the refused request.
            with s.engine_paused():
                s.proc.send_signal(signal.SIGTERM)
                ready = 200
                deadline = time.monotonic() + 30
                while ready == 200 and time.monotonic() < deadline:
                    ready = httpx.get(f"{s.url}/health/ready", timeout=10).status_code
                assert ready == 503
                refused = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x"}, timeout=10)
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["code"] == "draining"
            reason = _finish_reason(_events(lines))
        assert reason == "length"
        assert s.proc.wait(timeout=60) == 0
    finally:
        stop_server(s)


def test_engine_death_fails_in_flight_and_exits_nonzero(tmp_path: Path) -> None:
    s = start_server(tmp_path)
    try:
        engine = s.engine_pid()  # looked up first: the kill follows the first token at once
        body = {**LONG, "max_tokens": 200, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(engine, signal.SIGKILL)
            rest = [line for line in lines if line]
        assert any('"engine_dead"' in line for line in rest), rest[-3:]
        assert s.proc.wait(timeout=60) != 0
    finally:
        stop_server(s)
