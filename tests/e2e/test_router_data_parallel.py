"""`inferd serve --data-parallel-size 2`: one command, two engine replicas behind the router on
the main port, through the `openai` client; each replica publishes KV events on its own endpoint,
which the router follows; SIGTERM takes the replicas down with it."""

from __future__ import annotations

import itertools
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
from conftest import ROUTER_LINE, child_pids, probe_prompt, start_server

from inferd.telemetry.metrics import parse_samples


def test_data_parallel_serves_through_the_router_and_stops_its_replicas(tmp_path: Path) -> None:
    # Replica i publishes on `kv-i` (socket paths: no port to race other processes for).
    server = start_server(
        tmp_path,
        "--data-parallel-size", "2", "--kv-events-endpoint", f"ipc://{tmp_path}/kv",
        listening=ROUTER_LINE,
    )  # fmt: skip
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
        # The router follows both replicas' KV events (kv-0 and kv-1). ZeroMQ's slow joiner
        # may have dropped what they published before its subscriptions were up: probe each
        # replica until the router has counted a stored block from it.
        for i, replica in enumerate(sorted(seen)):
            _probe_until_counted(server.url, replica, first_probe=100 * i)
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


def _probe_until_counted(url: str, replica: str, first_probe: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    for i in itertools.count(first_probe):
        if _stored_events(url, replica):
            return
        assert time.monotonic() < deadline, "the router never received the replica's events"
        body = {"prompt": probe_prompt(i), "max_tokens": 1}
        assert httpx.post(f"{replica}/v1/completions", json=body, timeout=30).status_code == 200
        wait = time.monotonic() + 2
        while not _stored_events(url, replica) and time.monotonic() < wait:
            time.sleep(0.05)


def _stored_events(url: str, replica: str) -> float:
    samples = parse_samples(httpx.get(f"{url}/metrics", timeout=5).text)
    return samples.get(f'inferd_router_kv_events_total{{kind="stored",replica="{replica}"}}', 0.0)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
