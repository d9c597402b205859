"""`inferd serve --ray` as a user runs it: the command starts its own local Ray, serves the
application on Serve's proxy at --host/--port, answers through it, and on SIGTERM shuts Serve and
Ray down and exits 0. Skipped when ray is not installed. (test_ray_serve.py tests the application
itself on a Ray the test starts; this module runs after it, so one Ray runs at a time.)"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import ROOT, SMALL

pytest.importorskip("ray", reason="the Ray Serve path needs the ray extra")
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

READY = re.compile(rb"ready on Ray Serve: (http://\S+) ")
START_DEADLINE_S = 300.0  # a local Ray, Serve's controller and proxy, a replica: a loaded box


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(tmp: Path) -> tuple[subprocess.Popen[bytes], Path, str]:
    """The command, its log, and the URL its ready line names. Serve's proxy takes a fixed port
    (it reports none it would pick): a port taken before the proxy binds it fails the start,
    which is retried once on another."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120",  # see test_ray_serve.py
    }
    for attempt in range(2):
        log = tmp / f"serve-ray-{attempt}.log"
        cmd = [sys.executable, "-m", "inferd.cli", "serve", "inferd-tiny", "--ray"]
        cmd += ["--num-replicas", "1", "--host", "127.0.0.1", "--port", str(_free_port()), *SMALL]
        with log.open("wb") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        deadline = time.monotonic() + START_DEADLINE_S
        while proc.poll() is None and time.monotonic() < deadline:
            if (found := READY.search(log.read_bytes())) is not None:
                return proc, log, found.group(1).decode()
            time.sleep(0.5)
        _stop(proc)
        if b"bind" not in log.read_bytes().lower():
            break
    raise AssertionError(f"inferd serve --ray did not start:\n{log.read_text()[-5000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=60)


def test_serve_ray_answers_through_serves_proxy_and_exits_zero_on_sigterm(tmp_path: Path) -> None:
    proc, log, url = _start(tmp_path)
    try:
        body = {"model": "inferd-tiny", "prompt": "Once upon", "max_tokens": 3, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        assert r.headers["x-inferd-replica"]  # routed by inferd's request router
        models = httpx.get(f"{url}/v1/models", timeout=60).json()
        assert [m["id"] for m in models["data"]] == ["inferd-tiny"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=180) == 0, log.read_text()[-5000:]
        assert b"stopping: Serve drains the replicas" in log.read_bytes()
    finally:
        _stop(proc)
