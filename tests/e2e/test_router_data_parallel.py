"""`inferd serve --data-parallel-size 2`: one command, two engine replicas behind the router on
the main port, through the `openai` client; SIGTERM takes the replicas down with it."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
from conftest import child_pids, start_server


def test_data_parallel_serves_through_the_router_and_stops_its_replicas(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--data-parallel-size", "2")
    replicas = child_pids(server.proc.pid)
    try:
        deadline = time.monotonic() + 60
        while httpx.get(f"{server.url}/health/ready", timeout=5).json()["replicas_ready"] < 2:
            assert time.monotonic() < deadline, server.log.read_text()
            time.sleep(0.2)
        url = f"{server.url}/v1"
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as client:
            seen = set()
            for i in range(2):
                raw = client.completions.with_raw_response.create(
                    model="inferd-tiny", prompt=f"A different story, number {i}. " * 3, max_tokens=3
                )
                assert raw.parse().choices[0].finish_reason == "length"
                seen.add(raw.headers["x-inferd-replica"])
            assert len(seen) == 2  # two new prefix groups: one per replica
            chat = client.chat.completions.create(
                model="inferd-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            assert chat.choices[0].message.content is not None
    finally:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            raise
    assert server.proc.returncode == 0
    alive = [pid for pid in replicas if _running(pid)]
    assert alive == [], server.log.read_text()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
