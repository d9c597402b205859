"""Overload, deadlines, priority, SIGTERM drain and engine death, each on its own server."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from conftest import Server, start_server, stop_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

LONG = {"prompt": "Hello", "max_tokens": 120, "ignore_eos": True, "temperature": 0}


def _post_in_thread(
    url: str, body: dict[str, object], out: list[httpx.Response]
) -> threading.Thread:
    def run() -> None:
        out.append(httpx.post(url, json=body, timeout=60))

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
    """Holds the only running slot with a long stream until the block ends; closing the stream
    aborts it, so no test waits for a long generation."""
    release = threading.Event()
    body = {"prompt": "Hello", "max_tokens": 1500, "ignore_eos": True, "stream": True}

    def run() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            for _ in r.iter_lines():
                if release.is_set():
                    break

    t = threading.Thread(target=run)
    t.start()
    try:
        _wait_metric(server, "inferd_num_requests_running", 1)
        yield
    finally:
        release.set()
        t.join(60)


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
        t0 = time.monotonic()
        r = httpx.post(url, json=LONG, timeout=10)
        elapsed = time.monotonic() - t0
    assert r.status_code == 429, r.text
    assert int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "queue_full"
    # At once, not after the queued requests (the blocker holds them until it exits): the 50 ms it
    # takes on a quiet box, with room for a 2-core CI machine busy with other tests.
    assert elapsed < 1.0
    for t in threads:
        t.join(60)
    assert [x.status_code for x in results] == [200, 200]


def test_queue_deadline_gets_503(tight: Server) -> None:
    with blocker(tight):
        r = httpx.post(f"{tight.url}/v1/completions", json={**LONG, "timeout": 0.2}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout", r.text


def test_generation_deadline_finishes_with_timeout(tight: Server) -> None:
    body = {**LONG, "max_tokens": 1500, "timeout": 0.3}
    r = httpx.post(f"{tight.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "timeout"


def test_priority_serves_lower_value_first(tight: Server) -> None:
    url = f"{tight.url}/v1/completions"
    done: list[str] = []

    def tagged(tag: str, prio: int) -> threading.Thread:
        def run() -> None:
            httpx.post(url, json={**LONG, "max_tokens": 2, "priority": prio}, timeout=60)
            done.append(tag)

        t = threading.Thread(target=run)
        t.start()
        return t

    # Both wait in the admission queue behind the running request; the later, more urgent one
    # (lower value) must be released to the engine first.
    with blocker(tight):
        low = tagged("low", 5)
        _wait_metric(tight, "inferd_num_requests_queued", 1)
        high = tagged("high", 0)
        _wait_metric(tight, "inferd_num_requests_queued", 2)
    for t in (low, high):
        t.join(60)
    assert done == ["high", "low"]


def test_sigterm_drains_in_flight_then_exits_zero(tmp_path: Path) -> None:
    s = start_server(tmp_path)
    try:
        results: list[httpx.Response] = []
        body = {**LONG, "max_tokens": 240}
        t = _post_in_thread(f"{s.url}/v1/completions", body, results)
        _wait_metric(s, "inferd_num_requests_running", 1)
        s.proc.send_signal(signal.SIGTERM)
        ready = 200
        deadline = time.monotonic() + 2
        while ready == 200 and time.monotonic() < deadline:
            ready = httpx.get(f"{s.url}/health/ready", timeout=10).status_code
        assert ready == 503
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        t.join(60)
        assert results[0].status_code == 200
        assert results[0].json()["choices"][0]["finish_reason"] == "length"
        assert s.proc.wait(timeout=60) == 0
    finally:
        stop_server(s)


def test_engine_death_fails_in_flight_and_exits_nonzero(tmp_path: Path) -> None:
    s = start_server(tmp_path)
    try:
        body = {**LONG, "max_tokens": 200, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(s.engine_pid(), signal.SIGKILL)
            rest = [line for line in lines if line]
        assert any('"engine_dead"' in line for line in rest), rest[-3:]
        assert s.proc.wait(timeout=60) != 0
    finally:
        stop_server(s)
