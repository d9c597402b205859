"""A real `inferd serve` on a free loopback port, started per module, killed at the end."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from inferd.kv_cache.block_hash import block_hashes
from inferd.kv_cache.events import BlockStored, KVEventSubscriber
from inferd.telemetry.metrics import parse_samples

ROOT = Path(__file__).resolve().parents[2]
# Small limits keep start-up and every request fast on 2 CPU cores.
SMALL = [
    "--max-model-len", "256",
    "--kv-cache-memory", "8MiB",
    "--max-num-seqs", "4",
    "--num-threads", "1",
    "--request-timeout", "60",
    "--shutdown-timeout", "10",
    "--max-body-bytes", "65536",
]  # fmt: skip


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    _engine_pid: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self) -> dict[str, float]:
        """Unlabelled and labelled samples: `name{labels}` -> value."""
        return parse_samples(httpx.get(f"{self.url}/metrics", timeout=10).text)

    def engine_pid(self) -> int:
        """The engine core: the server's child process running Python (looked up once: it lives
        as long as the server)."""
        if self._engine_pid is None:
            self._engine_pid = _engine_child(self.proc.pid)
        return self._engine_pid

    @contextlib.contextmanager
    def engine_paused(self) -> Iterator[None]:
        """The engine core stopped (SIGSTOP) for the block, then continued: what it runs makes
        no step meanwhile, so a test decides when a generation goes on instead of racing it. The
        front keeps serving (admission, queue deadlines, readiness, metrics)."""
        pid = self.engine_pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)


# The log lines that name the port a server listens on (it binds port 0: the OS picks one).
READY_LINE = re.compile(rb"ready: https?://\S+?:(\d+)")
ROUTER_LINE = re.compile(rb"router on https?://\S+?:(\d+)")
_logs = itertools.count()


def start_server(
    tmp: Path, *extra: str, timeout_s: float = 120.0, listening: re.Pattern[bytes] = READY_LINE
) -> Server:
    """`inferd serve` on a port the OS picks (`--port 0`), read back from the log line that names
    it (`listening`), so nothing can take the port between a test choosing it and the server
    binding it; returns once /health/ready answers 200."""
    log = tmp / f"server-{next(_logs)}.log"
    cmd = [sys.executable, "-m", "inferd.cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", "0", *SMALL, *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    return wait_listening(proc, log, timeout_s, listening)


def wait_listening(
    proc: subprocess.Popen[bytes], log: Path, timeout_s: float, listening: re.Pattern[bytes]
) -> Server:
    """The server `proc` once its log names its port and its readiness answers 200."""
    deadline = time.monotonic() + timeout_s
    port: int | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        if port is None and (found := listening.search(log.read_bytes())) is not None:
            port = int(found.group(1))
        if port is not None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=1).status_code == 200:
                    return Server(proc, port, log)
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    stop_server(Server(proc, port or 0, log))
    raise RuntimeError(f"server not ready in {timeout_s} s:\n{log.read_text()}")


def _engine_child(server_pid: int) -> int:
    pids = child_pids(server_pid)
    for pid in pids:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"multiprocessing" in cmd and b"resource_tracker" not in cmd:
            return pid
    raise AssertionError(f"no engine child among {pids}")


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def stop_server(server: Server) -> None:
    # The engine core is a child; collect it first so no orphan is left holding a core.
    children = child_pids(server.proc.pid)
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(timeout=30)
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("server"))
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def model_name() -> str:
    return "inferd-tiny"


# Token ids no test prompt uses (theirs stay below 2,100; inferd-tiny's vocabulary has 4,096).
_PROBE_BASE = 3000


def probe_prompt(i: int, block_size: int = 16) -> list[int]:
    """A prompt of one full KV block that no other prompt shares (so storing it is news)."""
    return [_PROBE_BASE + i, *range(_PROBE_BASE + 500, _PROBE_BASE + 500 + block_size)]


def kv_events_connected(
    server: Server, subscriber: KVEventSubscriber, timeout_s: float = 60
) -> None:
    """Sends probe prompts to `server` until `subscriber` receives the BlockStored of the last
    one sent, reading everything before it: the replica's PUB socket drops what it publishes
    before a subscription has reached it (ZeroMQ's slow joiner), and delivers the rest in order,
    so afterwards every event the test causes arrives and nothing older is still on the way."""
    deadline = time.monotonic() + timeout_s
    for i in itertools.count():
        assert time.monotonic() < deadline, "the subscription never reached the publisher"
        prompt = probe_prompt(i)
        body = {"prompt": prompt, "max_tokens": 1}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        (want,) = block_hashes(prompt, 16)
        while (received := subscriber.receive(timeout_s=0.5)) is not None:
            events = received.batch.events
            if any(isinstance(e, BlockStored) and want in e.block_hashes for e in events):
                return
